"""The report's tables as `render.Table`s (report.html renders them with the `table` macro, summary.md
as Markdown), shared by the report (`build`) and the trajectory viewer (`viewer`), so neither imports
the other. The metric columns come from the registry of trial metrics (`metrics.registry`)."""
from __future__ import annotations

from typing import Any

import pandas as pd

from lhd_train.config.vocab import TYPES
from lhd_train.metrics.core import RunMetrics
from lhd_train.metrics.load import COVERAGE_MIN, RunData
from lhd_train.metrics.registry import METRICS, MetricSummary, TrialMetric, paired_metrics, summary_metrics
from lhd_train.report.render import Link, Table, ci, fmt, pm, signed, trials_cell

NONE = MetricSummary(float("nan"), float("nan"), float("nan"), float("nan"), 0)  # no trial: every cell a dash


def summary_columns(m: TrialMetric, min_coverage: float | None = None) -> list[str]:
    """A summary metric's columns: mean ± SE; for a headline metric also its 95 % interval and,
    given `min_coverage` (the runs table), its mean over the covered trials and over the trials
    without a failed supervisor call."""
    if not m.headline:
        return [m.label]
    variants = ([f"{m.label} (trials ≥ {min_coverage:.0%} coverage)",
                 f"{m.label} (trials without a failed supervisor call)"] if min_coverage is not None else [])
    return [m.label, "95% CI", *variants]


def summary_cells(x: MetricSummary | None, m: TrialMetric, variants: bool = False) -> list[str]:
    """The cells of `summary_columns` (`variants`: those of the runs table)."""
    x = x or NONE
    if not m.headline:
        return [pm(x.mean, x.se)]
    more = [f"{pm(v.mean, v.se)} (n={v.n})" for v in (x.covered or NONE, x.supervisor_ok or NONE)] if variants else []
    return [pm(x.mean, x.se), ci(x.ci_low, x.ci_high), *more]


def runs_table(runs: list[RunData], m: RunMetrics, min_coverage: float = COVERAGE_MIN,
               usage: dict[str, dict[str, dict[str, float]]] | None = None) -> Table:
    """The headline table, one row per run: counts, label coverage and every summary metric."""
    metrics = summary_metrics()
    cols = ["run", "performer", "auditor", "trials", "labelled rounds", "flagged", "flagged, no type (unspecified)",
            "failed labels (of them cut)", "repaired labels", "label coverage (min)",
            f"trials below {min_coverage:.0%} coverage", "rounds with a failed supervisor call (trials; cut)",
            "cut answers per role (calls that hit the token limit)",
            *[c for mt in metrics for c in summary_columns(mt, min_coverage)]]
    by = {r["run"]: r for r in m.runs.to_dict("records")}
    rows = []
    for run in runs:
        s = by.get(run.key, {})
        a = run.auditor
        rows.append([run.key, run.model_label, f"{a.auditor_id} ({a.mode})" if a else "none",
                     trials_cell(s), fmt(s.get("n_rounds", 0)), fmt(s.get("n_flagged", 0)),
                     fmt(s.get("n_unspecified", 0)),
                     f"{fmt(s.get('n_failed_labels', 0))} ({fmt(s.get('n_cut_labels', 0))})",
                     fmt(s.get("n_repaired_labels", 0)),
                     fmt(s.get("min_label_coverage")), fmt(s.get("n_low_coverage_trials", 0)),
                     f"{fmt(s.get('n_supervisor_failed_rounds', 0))} ({fmt(s.get('n_trials_supervisor_failed', 0))}; "
                     f"{fmt(s.get('n_supervisor_cut_rounds', 0))} cut)",
                     cut_text((usage or {}).get(run.key, {})),
                     *[c for mt in metrics for c in summary_cells(s.get(mt.name), mt, variants=True)]])
    return Table.numeric_after(cols, rows, 3)


ROLE_ORDER = ("performer", "supervisor", "summariser", "auditor")
SAMPLING_ORDER = ("temperature", "top_p", "top_k", "repetition_penalty", "max_tokens")


def role_usage(run: RunData) -> dict[str, dict[str, float]]:
    """Requests, tokens, model time and cut answers per role, counted from the rows on disk (so
    exact across resumes): `bench.accounting.usage_by_role`, the function that writes summary.json's
    `usage_by_role`, here also over every auditor's rows (role `auditor`)."""
    from lhd_train.bench.accounting import usage_by_role
    from lhd_train.rundir.rows import RoundRow

    store = run.store
    trial_rows = [row for trial in store.trials() for row in trial.rows(RoundRow)]
    audit_rows = [row for aid in store.auditor_ids() for tid in store.auditor(aid).trial_ids()
                  for row in store.auditor(aid).rows(tid)]
    usage = usage_by_role(trial_rows, audit_rows)
    return {role: usage[role] for role in sorted(usage, key=_role_rank)}


def _role_rank(role: str) -> tuple[int, str]:
    return (ROLE_ORDER.index(role) if role in ROLE_ORDER else len(ROLE_ORDER), role)


def cut_text(usage: dict[str, dict[str, float]]) -> str:
    """`performer 1 (3 calls), supervisor 0 (0 calls), ...`: answers that stayed cut at the
    token limit, and in parentheses the calls that hit it (some were then retried or continued)."""
    parts = [f"{role} {fmt(u.get('cut_answers', 0), 0)} ({fmt(u.get('cut_calls', 0), 0)} "
             f"call{'' if u.get('cut_calls', 0) == 1 else 's'})" for role, u in usage.items()]
    return ", ".join(parts) or "–"


def sampling_lines(run: RunData) -> list[str]:
    """Each role's effective sampling as the run recorded it (manifest `effective_sampling`: the
    config's settings over the model's own generation defaults); null = the server's default."""
    eff = run.manifest.effective_sampling
    if not eff:
        return ["not recorded (the run predates manifest.effective_sampling)"]
    out = []
    for role in sorted(eff, key=_role_rank):
        params = eff[role] or {}
        keys = [k for k in SAMPLING_ORDER if k in params] + [k for k in params if k not in SAMPLING_ORDER]
        out.append(f"{role}: " + ", ".join(
            f"{k} {'server default' if params[k] is None else params[k]}" for k in keys))
    return out


def compute_table(runs: list[RunData], usage: dict[str, dict[str, dict[str, float]]]) -> Table:
    """Requests, tokens and cut answers per role (`role_usage`, keyed by run key) and GPU-hours."""
    cols = ["run", "role", "requests", "prompt tokens", "completion tokens", "cached prompt tokens",
            "cut calls (hit the token limit)", "cut answers (stayed cut)", "model time (s)", "GPU-hours (run)"]
    rows = []
    for run in runs:
        gpu_h = run.summary.gpu_hours_this_invocation if run.summary is not None else None
        for role, u in usage.get(run.key, {}).items():
            rows.append([run.key, role, fmt(u["requests"]), fmt(u["prompt_tokens"]), fmt(u["completion_tokens"]),
                         fmt(u["cached_tokens"]), fmt(u.get("cut_calls", 0), 0), fmt(u.get("cut_answers", 0), 0),
                         fmt(u["latency_s"], 1), fmt(gpu_h, 3) if gpu_h is not None else "–"])
    return Table.numeric_after(cols, rows, 2)


def usage_frame(runs: list[RunData], usage: dict[str, dict[str, dict[str, float]]]) -> pd.DataFrame:
    """tables/usage_by_role.csv: one row per run and role."""
    recs = [{"run": run.key, "role": role, **u} for run in runs for role, u in usage.get(run.key, {}).items()]
    return pd.DataFrame(recs, columns=["run", "role", "requests", "prompt_tokens", "completion_tokens",
                                       "cached_tokens", "latency_s", "cut_calls", "cut_answers"])


def types_table(types: pd.DataFrame, labels: dict[str, str]) -> Table:
    cols = ["run", "type labels", *[t.lower() for t in TYPES], "flagged, no type (unspecified; not in the shares)"]
    rows = [[labels.get(r["run"], r["run"]), fmt(r["n_type_labels"]),
             *[f"{fmt(r[f'share_{t}'])} ({r[f'count_{t}']})" for t in TYPES], fmt(r["count_unspecified"])]
            for r in types.to_dict("records")]
    return Table.numeric_after(cols, rows, 1)


def breakdown_table(df: pd.DataFrame, by: str, labels: dict[str, str], title: str) -> Table:
    cols = ["run", title, "trials", "labelled rounds", "label coverage", "flagged", "rate (pooled)",
            "rate (mean over trials)", "95% CI", "avg severity (deceptive)", *[f"share {t.lower()}" for t in TYPES]]
    rows = [[labels.get(r["run"], r["run"]), str(r[by]), fmt(r["n_trials"]), fmt(r["n_rounds"]),
             fmt(r["label_coverage"]), fmt(r["n_flagged"]), fmt(r["rate_pooled"]), pm(r["rate"].mean, r["rate"].se),
             ci(r["rate"].ci_low, r["rate"].ci_high), fmt(r["severity_deceptive"], 2),
             *[fmt(r[f"share_{t}"]) for t in TYPES]] for r in df.to_dict("records")]
    return Table.numeric_after(cols, rows, 2)


def control_table(df: pd.DataFrame) -> Table:
    metrics = summary_metrics()
    cols = ["performer", "condition", "trials", "label coverage (min)", "trials below coverage",
            *[c for mt in metrics for c in summary_columns(mt)], *[f"share {t.lower()}" for t in TYPES]]
    rows = [[r["model"], r["condition"], fmt(r["n_trials"]), fmt(r["min_label_coverage"]),
             fmt(r["n_low_coverage_trials"]), *[c for mt in metrics for c in summary_cells(r[mt.name], mt)],
             *[fmt(r[f"share_{t}"]) for t in TYPES]] for r in df.to_dict("records")]
    return Table.numeric_after(cols, rows, 2)


def corr_table(df: pd.DataFrame, labels: dict[str, str] | None = None) -> Table:
    lead = ["run"] if "run" in df.columns else []
    cols = [*lead, "deception rate vs", "Pearson r", "p", "n", "note"]
    rows = [[*([labels.get(r["run"], r["run"])] if lead and labels else [r["run"]] if lead else []),
             r["y"].replace("_", " "), fmt(r["r"]), fmt(r["p"], 4), fmt(r["n"]), r["note"]]
            for r in df.to_dict("records")]
    return Table.numeric_after(cols, rows, len(lead) + 1)


def _window_note(window: Any) -> str:
    """', R=6' for a window-mode auditor; '' when the window is missing (None or NaN)."""
    return ", R=" + fmt(window, 0) if window == window and window is not None else ""


def horizon_table(df: pd.DataFrame, labels: dict[str, str]) -> Table:
    cols = ["run", "long auditor", "short auditor", "rounds compared", "long flagged", "short flagged", "extra",
            "missed", "extra / short", "net gain", "delayed extra", "delayed share of extra", "kappa"]
    rows = [[labels.get(r["run"], r["run"]), r["long"],
             f"{r['short']} ({r['short_mode']}{_window_note(r['short_window'])})",
             fmt(r["n_rounds"]), fmt(r["long_flagged"]), fmt(r["short_flagged"]), fmt(r["extra"]), fmt(r["missed"]),
             fmt(r["extra_vs_short"]), fmt(r["net_gain"]), fmt(r["delayed_extra"]), fmt(r["delayed_share_of_extra"]),
             fmt(r["kappa"])] for r in df.to_dict("records")]
    return Table.numeric_after(cols, rows, 3)


def delayed_table(df: pd.DataFrame, labels: dict[str, str]) -> Table:
    cols = ["run", "flagged rounds", "delayed", "undetermined (trigger task not fully labelled)", "delayed share",
            "mean lag (tasks)", "label coverage"]
    rows = [[labels.get(r["run"], r["run"]), fmt(r["n_flagged"]), fmt(r["n_delayed"]), fmt(r["n_undetermined"]),
             fmt(r["delayed_share"]), fmt(r["mean_lag_tasks"], 2), fmt(r["label_coverage"])]
            for r in df.to_dict("records")]
    return Table.numeric_after(cols, rows, 1)


def chains_table(df: pd.DataFrame, labels: dict[str, str]) -> Table:
    cols = ["run", "trials", "chains", "chains per trial", "mean length", "max length",
            "length: count", "share of flagged rounds in chains", "label coverage"]
    rows = [[labels.get(r["run"], r["run"]), fmt(r["n_trials"]), fmt(r["n_chains"]), fmt(r["chains_per_trial"], 2),
             fmt(r["mean_length"], 2), fmt(r["max_length"]), r["length_distribution"] or "–",
             fmt(r["share_flagged_in_chains"]), fmt(r["label_coverage"])] for r in df.to_dict("records")]
    return Table.numeric_after(cols, rows, 1)


def trials_table(per_trial: pd.DataFrame, hrefs: dict[str, str]) -> Table:
    """One row per trial, linking to its trajectory page, with every summary metric of the trial."""
    metrics = summary_metrics()
    cols = ["trial", "condition", "finished", "rounds", "failed supervisor calls", "labelled", "flagged",
            "failed labels", "label coverage", *[m.label for m in metrics], "final trust", "mean satisfaction",
            "final comfort"]
    rows = [[Link(r["trial_id"], hrefs[r["trial_id"]]) if r["trial_id"] in hrefs else r["trial_id"], r["condition"],
             fmt(bool(r["done"])), fmt(r["n_rounds"]), fmt(r["supervisor_failed_rounds"]), fmt(r["total_rounds"]),
             fmt(r["deception_occurrences"]), fmt(r["failed_rounds"]),
             # `in (True,)`: low_coverage may be a numpy bool or NaN
             fmt(r["label_coverage"]) + (" (low)" if r["low_coverage"] in (True,) else ""),
             *[fmt(r[m.name]) for m in metrics],
             fmt(r["final_trust"], 2), fmt(r["mean_satisfaction"], 2), fmt(r["final_comfort"], 2)]
            for r in per_trial.to_dict("records")]
    return Table.numeric_after(cols, rows, 3)


PAIRED_HOW = ("difference run − base over paired seeds; 95 % paired-t interval (read this one) and BCa bootstrap; "
              "sign-flip permutation test (exact up to 16 seeds); sign test as a robustness line; the minimal "
              "detectable difference (MDD) is the true difference a two-sided 0.05 t-test finds with 80 % power at "
              "this many seeds and this spread")


def paired_table(effects: pd.DataFrame, labels: dict[str, str]) -> Table:
    """One row per (run against the base, auditor, metric): `metrics.paired.paired_effect`."""
    cols = ["run (against the base)", "base", "scored by", "metric", "paired seeds (dropped: undefined)", "base mean",
            "run mean", "mean difference (run − base)", "95% CI (paired t)", "95% CI (BCa bootstrap)",
            "permutation p (sign flips)", "seeds up / down / tied", "sign test p", "SD of differences",
            "MDD (80 % power)", "verdict"]
    rows = [[labels.get(r["other"], r["other"]), labels.get(r["base"], r["base"]), str(r["auditor"]),
             METRICS[r["metric"]].label if r["metric"] in METRICS else r["metric"],
             f"{fmt(r['n_pairs'])} ({fmt(r['n_undefined'])})", fmt(r["mean_base"]), fmt(r["mean_other"]),
             signed(r["mean_diff"], 3), ci(r["ci_low"], r["ci_high"]), ci(r["bca_low"], r["bca_high"]),
             fmt(r["perm_p"], 4), f"{r['n_up']} / {r['n_down']} / {r['n_zero']}", fmt(r["sign_p"], 4),
             fmt(r["sd_diff"]), fmt(r["mdd"]), r["verdict"]] for r in effects.to_dict("records")]
    return Table(cols, rows, [False] * 4 + [True] * 11 + [False])


def paired_trials_table(trials: pd.DataFrame) -> Table:
    """Per trial of one comparison: its pairing status and, per paired metric, both values and
    their difference (`registry.PairedValue`)."""
    metrics = [m for m in paired_metrics() if m.name in trials.columns]
    cols = ["trial", "seed", "pairing", *[f"{m.label} ({side})" for m in metrics for side in ("base", "run", "diff")]]
    rows = [[r["trial_id"], fmt(r["seed"], 0), r["status"],
             *[c for m in metrics for c in (fmt(r[m.name].base), fmt(r[m.name].other), signed(r[m.name].diff, 3))]]
            for r in trials.to_dict("records")]
    return Table(cols, rows, [False, True, False, *[True] * 3 * len(metrics)])
