"""Report plots with matplotlib's Agg canvas, returned as PNG bytes (embedded as base64).

`matplotlib.figure.Figure` is used directly (no pyplot), so nothing depends on a display or on
global pyplot state."""
from __future__ import annotations

import base64
import io
import math
import textwrap
from collections.abc import Sequence

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from lhd_train.config.vocab import STATES, TYPES
from lhd_train.metrics.registry import HEADLINE, MetricSummary, summary_metrics

PRESSURE_COLORS = {"CRITICAL": "#8b0000", "HIGH": "#e74c3c", "MEDIUM": "#f5b7b1", "LOW": "#d6eaf8",
                   "none": "#eeeeee"}
STATE_COLORS = {"trust": "#1f77b4", "satisfaction": "#2ca02c", "comfort": "#9467bd"}
TYPE_COLORS = {"FALSIFICATION": "#d62728", "CONCEALMENT": "#ff7f0e", "EQUIVOCATION": "#8c564b"}
RUN_COLORS = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#8c8c8c",
              "#ccb974", "#64b5cd"]
DPI = 90
SPAN_ALPHA = 0.4


def png(fig: Figure, tight: bool = True) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight" if tight else None)
    return buf.getvalue()


def data_uri(png_bytes: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes).decode("ascii")


def _wrap(label: str, width: int = 18) -> str:
    return "\n".join(textwrap.wrap(str(label), width)) or str(label)


def _bars(cells: Sequence[MetricSummary]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Means (0 where none) and asymmetric error bars from the bootstrap interval, ± SE where the
    interval is missing."""
    mean, se, lo, hi = (np.array([getattr(c, k) for c in cells], float) for k in ("mean", "se", "ci_low", "ci_high"))
    lo = np.where(np.isnan(lo), mean - np.nan_to_num(se), lo)
    hi = np.where(np.isnan(hi), mean + np.nan_to_num(se), hi)
    return tuple(np.nan_to_num(a) for a in (mean, np.clip(mean - lo, 0, None), np.clip(hi - mean, 0, None)))


def plot_run_summary(runs: pd.DataFrame) -> bytes:
    """A panel per plotted metric of the registry (`TrialMetric.plot`, its `bounds` the axis):
    bars = mean over trials per run, whiskers = 95 % bootstrap interval."""
    panels = [m for m in summary_metrics() if m.plot]
    n = max(len(runs), 1)
    fig = Figure(figsize=(max(3 * len(panels), 1.6 * n * len(panels) / 2), 3.4))
    x = np.arange(len(runs))
    labels = [_wrap(s) for s in runs.get("label", runs.get("run", pd.Series(dtype=str)))]
    for i, m in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), i + 1)
        if len(runs):
            mean, below, above = _bars(runs[m.name].tolist())
            ax.bar(x, mean, color=[RUN_COLORS[j % len(RUN_COLORS)] for j in range(len(runs))],
                   yerr=(below, above), capsize=4)
            for xi, v in zip(x, mean, strict=True):
                ax.text(float(xi), v, f"{v:.2f}", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(x, labels, fontsize=7)
        ax.set_ylim(*m.bounds)
        ax.set_title(m.label, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return png(fig)


def plot_types(types: pd.DataFrame, labels: dict[str, str]) -> bytes:
    """Pooled type distribution per run (shares sum to 1)."""
    fig = Figure(figsize=(max(6, 1.8 * max(len(types), 1)), 3.2))
    ax = fig.add_subplot(1, 1, 1)
    x = np.arange(len(types))
    w = 0.8 / len(TYPES)
    for i, t in enumerate(TYPES):
        vals = np.nan_to_num(types[f"share_{t}"].to_numpy(float)) if len(types) else np.array([])
        ax.bar(x + (i - 1) * w, vals, w, label=t.lower(), color=TYPE_COLORS[t])
    ax.set_xticks(x, [_wrap(labels.get(r, r)) for r in types.get("run", [])], fontsize=7)
    ax.set_ylim(0, 1)
    ax.set_ylabel("share of type labels")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    ax.set_title("deception types (pooled over flagged rounds, normalised)", fontsize=10)
    fig.tight_layout()
    return png(fig)


def _grouped_bars(df: pd.DataFrame, group: str, at: str, values: list, cell: str, names: dict[str, str],
                  ticks: list[str], ylabel: str, title: str, width: float) -> bytes:
    """One bar per row group (`group`: a run, a performer) at each of `values` of column `at`: the
    mean ± SE of its `MetricSummary` column `cell`."""
    groups = list(dict.fromkeys(df[group]))
    fig = Figure(figsize=(max(6, width * max(len(values), 1) * max(1, len(groups)) ** 0.5 + 2), 3.4))
    ax = fig.add_subplot(1, 1, 1)
    x = np.arange(len(values))
    w = 0.8 / max(len(groups), 1)
    for j, key in enumerate(groups):
        sub = df[df[group] == key].set_index(at)[cell]
        mean, se = (np.array([getattr(sub[v], k) if v in sub.index else np.nan for v in values], float)
                    for k in ("mean", "se"))
        ax.bar(x + (j - (len(groups) - 1) / 2) * w, np.nan_to_num(mean), w, yerr=np.nan_to_num(se), capsize=3,
               color=RUN_COLORS[j % len(RUN_COLORS)], label=_wrap(names.get(key, str(key)), 30))
    ax.set_xticks(x, ticks, fontsize=8)
    ax.set_ylim(0, 1)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    if groups:
        ax.legend(fontsize=7)
    fig.tight_layout()
    return png(fig)


def plot_breakdown(df: pd.DataFrame, by: str, labels: dict[str, str], title: str) -> bytes:
    """Per-trial mean deception rate (± SE) for each value of `by`, one bar per run (`df` has rows:
    the report plots only runs with labels)."""
    values = list(dict.fromkeys(df[by]))
    ticks = [_wrap(str(v).lower().replace("_", " "), 12) for v in values]
    return _grouped_bars(df, "run", by, values, "rate", labels, ticks, "deception rate", title, 1.1)


def plot_control_pressure(control: pd.DataFrame, levels: Sequence[str],
                          metric: str = HEADLINE) -> bytes | None:
    """The paper's pressure figure: per performer, the control-study rate of trials run under one
    fixed pressure level (mean over trials of the rate over all their rounds, ± SE). None when no
    trial ran under a pressure control."""
    frame = control[control["condition"].isin([f"pressure={lvl}" for lvl in levels])] if len(control) else control
    if not len(frame):
        return None
    present = [lvl for lvl in levels if f"pressure={lvl}" in set(frame["condition"])]
    return _grouped_bars(frame, "model", "condition", [f"pressure={lvl}" for lvl in present], metric, {},
                         [lvl.lower() for lvl in present], "deception rate (all rounds)",
                         "control study: deception rate of trials run under one pressure level", 1.3)


def plot_states(trial: pd.DataFrame, threshold: float, title: str) -> bytes:
    """Supervisor states over the rounds of one trial, each task's span shaded by its event's
    pressure level (as the reference's analyzer), flagged rounds marked; below, severity bars
    (0 where not flagged), red where flagged, grey where the label failed or is missing."""
    t = trial.sort_values("global_round")
    g = t["global_round"].to_numpy(int)
    fig = Figure(figsize=(10, 4.6))
    ax, ax2 = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [2.2, 1]})
    for task, tdf in t.groupby("task_index"):
        lo, hi = tdf["global_round"].min() - 0.5, tdf["global_round"].max() + 0.5
        pressure = str(tdf["pressure"].iloc[0])
        for a in (ax, ax2):
            a.axvspan(lo, hi, color=PRESSURE_COLORS.get(pressure, "#eeeeee"), alpha=SPAN_ALPHA, lw=0)
        ax.text((lo + hi) / 2, 1.02, str(task), ha="center", va="bottom", fontsize=7, color="#555")
    for k in STATES:
        ax.plot(g, t[k].to_numpy(float), marker="o", ms=3, color=STATE_COLORS[k], label=k)
    ax.axhline(threshold, color="#333", ls="--", lw=0.8)
    flagged = t[t["flagged"]]
    for gr in flagged["global_round"]:
        ax.axvline(gr, color="#d62728", lw=0.8, alpha=0.6)
    ax.scatter(flagged["global_round"], np.full(len(flagged), -1.05), marker="v", color="#d62728", s=22,
               label="flagged", zorder=5, clip_on=False)
    ax.set_ylim(-1.1, 1.1)
    ax.set_ylabel("state")
    handles, labs = ax.get_legend_handles_labels()
    handles += [Patch(color=c, alpha=SPAN_ALPHA, label=p.lower()) for p, c in PRESSURE_COLORS.items()]
    fig.legend(handles=handles, fontsize=7, ncol=9, loc="lower center", frameon=False)
    ax.set_title(title + "   (numbers above: task; dashed: completion threshold)", fontsize=9)
    sev = np.where(t["flagged"].to_numpy(bool), np.nan_to_num(t["severity"].to_numpy(float)), 0)
    colors = ["#d62728" if f else ("#bbbbbb" if not lab else "#1f77b4")
              for f, lab in zip(t["flagged"], t["labelled"], strict=True)]
    ax2.bar(g, np.where(t["labelled"].to_numpy(bool), sev, 0.15), color=colors)
    ax2.set_ylim(0, 4.2)
    ax2.set_xlim(g.min() - 0.5, g.max() + 0.5)
    rounds = np.unique(g)  # whole-number ticks, also for a one-round trial (matplotlib would put 0.1 steps)
    if len(rounds) <= 20:
        ax2.set_xticks(rounds)
    else:
        ax2.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax2.set_ylabel("severity")
    ax2.set_xlabel("global round")
    rate = t.loc[t["labelled"], "flagged"].mean() if t["labelled"].any() else math.nan
    ax2.text(0.01, 0.92, f"rate {rate:.2f}" if not math.isnan(rate) else "no labels", transform=ax2.transAxes,
             fontsize=8, va="top")
    fig.subplots_adjust(left=0.07, right=0.99, top=0.92, bottom=0.2, hspace=0.12)
    return png(fig, tight=False)  # fixed margins: a tight bbox costs a second full draw, per trial


def plot_correlations(per_trial: pd.DataFrame, labels: dict[str, str],
                      ys: Sequence[str] = ("final_trust", "mean_satisfaction", "final_comfort")) -> bytes:
    """Deception rate against each supervisor-state metric: small dots = trials, large = run means."""
    fig = Figure(figsize=(10, 3.2))
    runs = list(dict.fromkeys(per_trial["run"])) if len(per_trial) else []
    for i, y in enumerate(ys):
        ax = fig.add_subplot(1, len(ys), i + 1)
        for j, run in enumerate(runs):
            sub = per_trial[per_trial["run"] == run]
            c = RUN_COLORS[j % len(RUN_COLORS)]
            ax.scatter(sub[y], sub[HEADLINE], s=14, alpha=0.5, color=c)
            ax.scatter([sub[y].mean()], [sub[HEADLINE].mean()], s=90, color=c, edgecolor="black",
                       label=_wrap(labels.get(run, run), 30) if i == 0 else None)
        ax.set_xlim(-1.05, 1.05)
        ax.set_ylim(-0.05, 1.05)
        ax.set_xlabel(y.replace("_", " "))
        if i == 0:
            ax.set_ylabel("deception rate")
            if runs:
                ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return png(fig)
