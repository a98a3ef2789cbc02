"""Markdown, heatmap and files from the AUROC tables of a read (`lhd_train.reading.tables`).

Files written by `write_outputs`:
`margins.parquet` (long: example × readout × layer × position), `examples.parquet`,
`auroc.csv` (metric × readout × position × layer, pooled and within-stratum AUROC with CIs and
each row's role), `layers.csv` (emergence, in-sample best layer, nested held-out choice),
`baselines.csv`, `auroc.md` (THE primary result first, then baselines, negative controls and
the exploratory tables), `heatmap.png`, `summary.json`.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from lens.files import atomic_write, atomic_write_text, write_csv, write_json
from lens.positions import POSITION_CLASSES
from lens.readout import READOUTS
from lens.readout_probe import PROBE
from lhd_train.reading.tables import CONTROL, EXPLORATORY, PRIMARY, STATED, exploratory_note

READOUT_ORDER = [*READOUTS, PROBE, STATED]


def _ordered(names: Any) -> list[str]:
    """The readouts in `names` in READOUT_ORDER, then any other in name order."""
    present = set(names)
    return [r for r in READOUT_ORDER if r in present] + sorted(present - set(READOUT_ORDER))


def _ci(x: Any, lo: Any, hi: Any) -> str:
    if x is None or pd.isna(x):
        return "–"
    if pd.isna(lo):
        return f"{x:.2f}"
    return f"{x:.2f} [{lo:.2f}, {hi:.2f}]"


def _cell(r: pd.Series) -> str:
    """Within-stratum AUROC [CI], pooled beside it."""
    return f"{_ci(r['auroc_within'], r['within_lo'], r['within_hi'])} (pooled {_ci(r['auroc'], None, None)})" \
        if not pd.isna(r["auroc"]) else "–"


def _primary_lines(summary: dict) -> list[str]:
    p = summary.get("primary_result") or {}
    d = p.get("declared") or summary.get("primary") or {}
    band = summary.get("primary", {}).get("band_layers")
    lines = ["## THE primary result (declared in the settings and written to plan.json before reading)", "",
             f"metric `{d.get('metric')}`, readout `{d.get('readout')}`, anchor `{d.get('anchor')}`, band "
             f"{d.get('band')} of depth (layers {band[0]}–{band[1]})" if band else "", ""]
    if not p.get("found"):
        return lines + [f"Not available: {p.get('why')}.", ""]
    rho = "–" if p.get("echo_rho") is None or pd.isna(p["echo_rho"]) else f"{p['echo_rho']:.2f}"
    return lines + ["| within-stratum AUROC [95% CI] | pooled AUROC [95% CI] | n_pos | n_neg | clusters | "
                    "within pairs | echo ρ |", "|---|---|---|---|---|---|---|",
                    f"| {_ci(p['auroc_within'], p['within_lo'], p['within_hi'])} | "
                    f"{_ci(p['auroc'], p['ci_lo'], p['ci_hi'])} | {p['n_pos']} | {p['n_neg']} | {p['n_clusters']} | "
                    f"{p['n_within_pairs']} | {rho} |", "",
                    "Everything below is exploratory or a control.", ""]


def _baseline_lines(base: pd.DataFrame) -> list[str]:
    if base.empty:
        return []
    lines = ["## Baselines (not lens readouts: what the labels share with length, the task, the echoed words)", "",
             "| baseline | score | within-stratum AUROC [95% CI] | pooled AUROC [95% CI] |", "|---|---|---|---|"]
    for _, r in base.iterrows():
        lines.append(f"| {r['baseline']} | {r['score']} | {_ci(r['auroc_within'], r['within_lo'], r['within_hi'])} | "
                     f"{_ci(r['auroc'], r['ci_lo'], r['ci_hi'])} |")
    return lines + [""]


def _metric_tables(table: pd.DataFrame, heading: str) -> list[str]:
    lines: list[str] = []
    for metric, g in table.groupby("metric", sort=False):
        g = g.assign(cell=g.apply(_cell, axis=1))
        order = _ordered(g["readout"])
        cols = [(ro, pos) for ro in order for pos in dict.fromkeys(g[g["readout"] == ro]["position"])]
        layers = sorted(g["layer"].unique())
        lines += [f"## {heading}: {metric}", "", "within-stratum AUROC [95% CI, cluster bootstrap] (pooled AUROC)", "",
                  "| layer | " + " | ".join(f"{ro} · {pos}" for ro, pos in cols) + " |", "|---|" + "---|" * len(cols)]
        for layer in layers:
            cells = []
            for ro, pos in cols:
                hit = g[(g["layer"] == layer) & (g["readout"] == ro) & (g["position"] == pos)]
                cells.append(hit["cell"].iloc[0] + (" **primary**" if (hit["role"] == PRIMARY).any() else "")
                             if len(hit) else "")
            lines.append(f"| {'band' if layer < 0 else layer} | " + " | ".join(cells) + " |")
        n = g.iloc[0]
        lines += ["", f"n_pos = {int(n['n_pos'])}, n_neg = {int(n['n_neg'])}, clusters = {int(n['n_clusters'])}, "
                      f"within-stratum pairs = {int(n['n_within_pairs'])}", ""]
    return lines


def _choice_lines(choice: pd.DataFrame) -> list[str]:
    if choice.empty:
        return []
    lines = ["## Layer choice (exploratory). Emergence: first layer with within-stratum AUROC ≥ threshold and CI "
             "low > 0.5 for 3 consecutive layers; best in-sample: chosen on the data it is scored on (optimistic); "
             "nested: chosen on the training clusters of each fold, scored on the held-out ones", "",
             "| metric | readout | position | emergence | best in-sample (AUROC) | nested held-out AUROC "
             "(layers chosen) |", "|---|---|---|---|---|---|"]
    for _, r in choice.iterrows():
        em = "–" if r["emergence_layer"] is None or pd.isna(r["emergence_layer"]) else int(r["emergence_layer"])
        best = "–" if pd.isna(r["best_auroc_in_sample"]) else \
            f"L{int(r['best_layer_in_sample'])} ({r['best_auroc_in_sample']:.2f})"
        nested = "–" if pd.isna(r["nested_auroc"]) else f"{r['nested_auroc']:.2f} ({r['nested_layers']})"
        lines.append(f"| {r['metric']} | {r['readout']} | {r['position']} | {em} | {best} | {nested} |")
    return lines + [""]


def markdown(table: pd.DataFrame, choice: pd.DataFrame, baselines: pd.DataFrame, summary: dict, *, title: str,
             notes: Sequence[str] = ()) -> str:
    lines = [f"# {title}", ""] + [f"- {n}" for n in notes] + ([""] if notes else [])
    lines += _primary_lines(summary)
    lines += _baseline_lines(baselines)
    if table.empty:
        return "\n".join(lines + ["(no labelled example: no AUROC)", ""])
    control = table[table["role"] == CONTROL]
    if len(control):
        lines += ["# Negative controls: positions before the judged text (expected AUROC 0.5; not findings)", ""]
        lines += _metric_tables(control, "Negative control")
    explore = table[table["role"] == EXPLORATORY]
    lines += ["# Exploratory", "", exploratory_note(explore["within_lo"], explore["within_hi"]), ""]
    lines += _metric_tables(table[table["role"] != CONTROL], "Exploratory")
    return "\n".join(lines + _choice_lines(choice))


def heatmap(table: pd.DataFrame, metric_key: str, path: Path, *, title: str) -> Path | None:
    """Layer × position class, one panel per readout: the within-stratum AUROC of one metric's anchors."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = table[(table["metric_key"] == metric_key) & (table["layer"] >= 0)]
    if t.empty or t["auroc_within"].isna().all():
        return None
    readouts = _ordered(set(t["readout"]) - {STATED})
    layers = sorted(t["layer"].unique())
    fig, axes = plt.subplots(1, len(readouts), figsize=(2.6 * len(readouts) + 1.2, 0.28 * len(layers) + 2.2),
                             squeeze=False, sharey=True, layout="constrained")
    im = None
    for ax, ro in zip(axes[0], readouts, strict=True):
        M = np.full((len(layers), len(POSITION_CLASSES)), np.nan)
        for _, r in t[t["readout"] == ro].iterrows():
            M[layers.index(r["layer"]), POSITION_CLASSES.index(r["position_class"])] = r["auroc_within"]
        im = ax.imshow(M, vmin=0.0, vmax=1.0, cmap="RdBu_r", aspect="auto", origin="lower")
        ax.set_title(ro)
        ax.set_xticks(range(len(POSITION_CLASSES)), POSITION_CLASSES, rotation=30)
        ax.set_yticks(range(len(layers)), [str(layer) for layer in layers])
        if len(layers) <= 48:
            for i in range(len(layers)):
                for j in range(len(POSITION_CLASSES)):
                    if np.isfinite(M[i, j]):
                        ax.text(j, i, f"{M[i, j]:.2f}", ha="center", va="center", fontsize=6)
    axes[0][0].set_ylabel("layer")
    metric = t["metric"].iloc[0]
    fig.suptitle(f"{title}\nwithin-stratum AUROC, {metric} (anchors before the judged text are controls)",
                 fontsize=9)
    assert im is not None  # one image per readout, and `plt.subplots` refuses zero columns
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8)
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=130, bbox_inches="tight"))
    plt.close(fig)
    return path


def write_outputs(out_dir: Path, margins_df: pd.DataFrame, examples_df: pd.DataFrame, table: pd.DataFrame,
                  choice: pd.DataFrame, baselines: pd.DataFrame, summary: dict, *, title: str,
                  notes: Sequence[str] = ()) -> dict[str, str]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files: dict[str, str] = {}
    m = margins_df.copy()
    m["label"] = m["label"].astype(str)
    atomic_write(out / "margins.parquet", lambda tmp: m.to_parquet(tmp, index=False))
    e = examples_df.copy()
    e["label"] = e["label"].astype(str)
    atomic_write(out / "examples.parquet", lambda tmp: e.to_parquet(tmp, index=False))
    files.update(margins=str(out / "margins.parquet"), examples=str(out / "examples.parquet"))
    write_csv(table, out / "auroc.csv")  # text cells never start a formula (lhd_train/io/csv_cells.py)
    write_csv(choice, out / "layers.csv")
    write_csv(baselines, out / "baselines.csv")
    atomic_write_text(out / "auroc.md", markdown(table, choice, baselines, summary, title=title, notes=notes))
    files.update(auroc_csv=str(out / "auroc.csv"), auroc_md=str(out / "auroc.md"), layers=str(out / "layers.csv"),
                 baselines=str(out / "baselines.csv"))
    key = (summary.get("primary") or {}).get("metric")
    png = heatmap(table, key, out / "heatmap.png", title=title) if key and not table.empty else None
    if png is None and not table.empty:
        png = heatmap(table, str(table["metric_key"].iloc[0]), out / "heatmap.png", title=title)
    if png:
        files["heatmap"] = str(png)
    write_json(out / "summary.json", {**summary, "files": files})
    files["summary"] = str(out / "summary.json")
    return files
