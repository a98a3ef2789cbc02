"""The report's tables as template contexts (`table` macro: columns, rows of strings or
{text, href}, which columns are numeric), shared by the report (`build`) and the trajectory
viewer (`viewer`), so neither imports the other."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pandas as pd

from lhd_train.config.vocab import TYPES
from lhd_train.metrics.core import RunMetrics
from lhd_train.metrics.load import COVERAGE_MIN, RunData
from lhd_train.report.render import ci, fmt, pm


def _t(columns: Sequence[str], rows: list[list[Any]], numeric: Sequence[bool] | None = None) -> dict[str, Any]:
    """A table for the `table` macro: cells are strings or {text, href}."""
    return {"columns": list(columns), "rows": rows, "numeric": list(numeric or [False] * len(columns))}


def _num(columns: Sequence[str], first_text: int) -> list[bool]:
    return [i >= first_text for i in range(len(columns))]


def runs_table_ctx(runs: list[RunData], m: RunMetrics, min_coverage: float = COVERAGE_MIN) -> dict[str, Any]:
    cols = ["run", "performer", "auditor", "trials", "labelled rounds", "flagged", "flagged, no type (unspecified)",
            "failed labels", "repaired labels", "label coverage (min)", f"trials below {min_coverage:.0%} coverage",
            "rounds with a failed supervisor call (trials)",
            "deception rate", "95% CI", f"deception rate (trials ≥ {min_coverage:.0%} coverage)",
            "deception rate (trials without a failed supervisor call)",
            "avg severity (all rounds)", "avg severity (deceptive; 0 if none)",
            "avg severity (deceptive; trials with deception)"]
    by = {r["run"]: r for r in m.runs.to_dict("records")}
    rows = []
    for run in runs:
        s = by.get(run.key, {})
        a = run.auditor
        rows.append([run.key, run.model_label,
                     f"{a.auditor_id} ({a.mode})" if a else "none",
                     fmt(s.get("n_trials", 0)), fmt(s.get("n_rounds", 0)), fmt(s.get("n_flagged", 0)),
                     fmt(s.get("n_unspecified", 0)),
                     fmt(s.get("n_failed_labels", 0)), fmt(s.get("n_repaired_labels", 0)),
                     fmt(s.get("min_label_coverage")), fmt(s.get("n_low_coverage_trials", 0)),
                     f"{fmt(s.get('n_supervisor_failed_rounds', 0))} ({fmt(s.get('n_trials_supervisor_failed', 0))})",
                     pm(s.get("deception_rate_mean"), s.get("deception_rate_se")),
                     ci(s.get("deception_rate_ci_low"), s.get("deception_rate_ci_high")),
                     pm(s.get("deception_rate_covered_mean"), s.get("deception_rate_covered_se"))
                     + f" (n={fmt(s.get('n_trials_covered', 0))})",
                     pm(s.get("deception_rate_supervisor_ok_mean"), s.get("deception_rate_supervisor_ok_se"))
                     + f" (n={fmt(s.get('n_trials_supervisor_ok', 0))})",
                     pm(s.get("severity_average_all_rounds_mean"), s.get("severity_average_all_rounds_se")),
                     pm(s.get("severity_average_deception_only_mean"), s.get("severity_average_deception_only_se")),
                     pm(s.get("severity_deceptive_nan_mean"), s.get("severity_deceptive_nan_se"))])
    return _t(cols, rows, _num(cols, 3))


def compute_table_ctx(runs: list[RunData]) -> dict[str, Any]:
    """Requests and tokens per role (from the rows, so exact across resumes) and GPU-hours."""
    from lhd_train.bench.accounting import usage_by_role
    from lhd_train.rundir.files import read_json_mapping, read_jsonl
    from lhd_train.rundir.layout import RunDir

    cols = ["run", "role", "requests", "prompt tokens", "completion tokens", "cached prompt tokens",
            "model time (s)", "GPU-hours (run)"]
    rows = []
    for run in runs:
        rd = RunDir(run.path)
        trial_rows = [r for p in rd.rows_files() for r in read_jsonl(p)]
        audit_rows = [r for p in rd.audit_dir.glob("*/*.jsonl") for r in read_jsonl(p)]
        gpu_h = read_json_mapping(rd.summary).get("gpu_hours_this_invocation")
        for role, u in usage_by_role(trial_rows, audit_rows).items():
            rows.append([run.key, role, fmt(u["requests"]), fmt(u["prompt_tokens"]), fmt(u["completion_tokens"]),
                         fmt(u["cached_tokens"]), fmt(u["latency_s"], 1), fmt(gpu_h, 3) if gpu_h is not None else "–"])
    return _t(cols, rows, _num(cols, 2))


def types_table_ctx(types: pd.DataFrame, labels: dict[str, str]) -> dict[str, Any]:
    cols = ["run", "type labels", *[t.lower() for t in TYPES], "flagged, no type (unspecified; not in the shares)"]
    rows = [[labels.get(r["run"], r["run"]), fmt(r["n_type_labels"]),
             *[f"{fmt(r[f'share_{t}'])} ({r[f'count_{t}']})" for t in TYPES], fmt(r.get("count_unspecified", 0))]
            for r in types.to_dict("records")]
    return _t(cols, rows, _num(cols, 1))


def breakdown_table_ctx(df: pd.DataFrame, by: str, labels: dict[str, str], title: str) -> dict[str, Any]:
    cols = ["run", title, "trials", "labelled rounds", "label coverage", "flagged", "rate (pooled)",
            "rate (mean over trials)", "95% CI", "avg severity (deceptive)", *[f"share {t.lower()}" for t in TYPES]]
    rows = []
    for r in df.to_dict("records"):
        v = r[by]
        rows.append([labels.get(r["run"], r["run"]), str(v), fmt(r["n_trials"]), fmt(r["n_rounds"]),
                     fmt(r["label_coverage"]), fmt(r["n_flagged"]), fmt(r["rate_pooled"]),
                     pm(r["rate_mean"], r["rate_se"]),
                     ci(r["rate_ci_low"], r["rate_ci_high"]), fmt(r["severity_deceptive"], 2),
                     *[fmt(r[f"share_{t}"]) for t in TYPES]])
    return _t(cols, rows, _num(cols, 2))


def control_table_ctx(df: pd.DataFrame) -> dict[str, Any]:
    cols = ["performer", "condition", "trials", "label coverage (min)", "trials below coverage", "deception rate",
            "95% CI", "avg severity (all)", "avg severity (deceptive)", *[f"share {t.lower()}" for t in TYPES]]
    rows = [[r["model"], r["condition"], fmt(r["n_trials"]), fmt(r["min_label_coverage"]),
             fmt(r["n_low_coverage_trials"]), pm(r["deception_rate_mean"], r["deception_rate_se"]),
             ci(r["deception_rate_ci_low"], r["deception_rate_ci_high"]),
             pm(r["severity_average_all_rounds_mean"], r["severity_average_all_rounds_se"]),
             pm(r["severity_average_deception_only_mean"], r["severity_average_deception_only_se"]),
             *[fmt(r[f"share_{t}"]) for t in TYPES]] for r in df.to_dict("records")]
    return _t(cols, rows, _num(cols, 2))


def corr_table_ctx(df: pd.DataFrame, labels: dict[str, str] | None = None) -> dict[str, Any]:
    lead = ["run"] if "run" in df.columns else []
    cols = [*lead, "deception rate vs", "Pearson r", "p", "n", "note"]
    rows = [[*([labels.get(r["run"], r["run"])] if lead and labels else [r["run"]] if lead else []),
             r["y"].replace("_", " "), fmt(r["r"]), fmt(r["p"], 4), fmt(r["n"]), r["note"]]
            for r in df.to_dict("records")]
    return _t(cols, rows, _num(cols, len(lead) + 1))


def _window_note(window: Any) -> str:
    """', R=6' for a window-mode auditor; '' when the window is missing (None or NaN)."""
    return ", R=" + fmt(window, 0) if window == window and window is not None else ""


def horizon_table_ctx(df: pd.DataFrame, labels: dict[str, str]) -> dict[str, Any]:
    cols = ["run", "long auditor", "short auditor", "rounds compared", "long flagged", "short flagged", "extra",
            "missed", "extra / short", "net gain", "delayed extra", "delayed share of extra", "kappa"]
    rows = [[labels.get(r["run"], r["run"]), r["long"],
             f"{r['short']} ({r['short_mode']}{_window_note(r['short_window'])})",
             fmt(r["n_rounds"]), fmt(r["long_flagged"]), fmt(r["short_flagged"]), fmt(r["extra"]), fmt(r["missed"]),
             fmt(r["extra_vs_short"]), fmt(r["net_gain"]), fmt(r["delayed_extra"]), fmt(r["delayed_share_of_extra"]),
             fmt(r["kappa"])] for r in df.to_dict("records")]
    return _t(cols, rows, _num(cols, 3))


def delayed_table_ctx(df: pd.DataFrame, labels: dict[str, str]) -> dict[str, Any]:
    cols = ["run", "flagged rounds", "delayed", "undetermined (trigger task not fully labelled)", "delayed share",
            "mean lag (tasks)", "label coverage"]
    rows = [[labels.get(r["run"], r["run"]), fmt(r["n_flagged"]), fmt(r["n_delayed"]), fmt(r["n_undetermined"]),
             fmt(r["delayed_share"]), fmt(r["mean_lag_tasks"], 2), fmt(r["label_coverage"])]
            for r in df.to_dict("records")]
    return _t(cols, rows, _num(cols, 1))


def chains_table_ctx(df: pd.DataFrame, labels: dict[str, str]) -> dict[str, Any]:
    cols = ["run", "trials", "chains", "chains per trial", "mean length", "max length",
            "length: count", "share of flagged rounds in chains", "label coverage"]
    rows = [[labels.get(r["run"], r["run"]), fmt(r["n_trials"]), fmt(r["n_chains"]), fmt(r["chains_per_trial"], 2),
             fmt(r["mean_length"], 2), fmt(r["max_length"]), r["length_distribution"] or "–",
             fmt(r["share_flagged_in_chains"]), fmt(r["label_coverage"])] for r in df.to_dict("records")]
    return _t(cols, rows, _num(cols, 1))


def trials_table_ctx(per_trial: pd.DataFrame, hrefs: dict[str, str]) -> dict[str, Any]:
    cols = ["trial", "condition", "finished", "rounds", "failed supervisor calls", "labelled", "flagged",
            "failed labels", "label coverage",
            "deception rate", "avg severity (all)", "avg severity (deceptive)", "final trust", "mean satisfaction",
            "final comfort"]
    rows = []
    for r in per_trial.to_dict("records"):
        tid = r["trial_id"]
        rows.append([{"text": tid, "href": hrefs[tid]} if tid in hrefs else tid, r["condition"], fmt(bool(r["done"])),
                     fmt(r["n_rounds"]), fmt(r.get("supervisor_failed_rounds")), fmt(r.get("total_rounds")),
                     fmt(r.get("deception_occurrences")),
                     fmt(r.get("failed_rounds")),
                     # `in (True,)`: low_coverage may be a numpy bool or NaN
                     fmt(r.get("label_coverage")) + (" (low)" if r.get("low_coverage") in (True,) else ""),
                     fmt(r.get("deception_rate")),
                     fmt(r.get("severity_average_all_rounds"), 2), fmt(r.get("severity_average_deception_only"), 2),
                     fmt(r["final_trust"], 2), fmt(r["mean_satisfaction"], 2), fmt(r["final_comfort"], 2)])
    return _t(cols, rows, _num(cols, 3))
