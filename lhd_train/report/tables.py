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
from lhd_train.metrics.paired import MIN_PAIRS, PairedComparison
from lhd_train.report.render import ci, fmt, pm, signed, trials_cell


def _t(columns: Sequence[str], rows: list[list[Any]], numeric: Sequence[bool] | None = None) -> dict[str, Any]:
    """A table for the `table` macro: cells are strings or {text, href}."""
    return {"columns": list(columns), "rows": rows, "numeric": list(numeric or [False] * len(columns))}


def _num(columns: Sequence[str], first_text: int) -> list[bool]:
    return [i >= first_text for i in range(len(columns))]


def runs_table_ctx(runs: list[RunData], m: RunMetrics, min_coverage: float = COVERAGE_MIN,
                   usage: dict[str, dict[str, dict[str, float]]] | None = None) -> dict[str, Any]:
    cols = ["run", "performer", "auditor", "trials", "labelled rounds", "flagged", "flagged, no type (unspecified)",
            "failed labels (of them cut)", "repaired labels", "label coverage (min)",
            f"trials below {min_coverage:.0%} coverage",
            "rounds with a failed supervisor call (trials; cut)",
            "cut answers per role (calls that hit the token limit)",
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
                     trials_cell(s), fmt(s.get("n_rounds", 0)), fmt(s.get("n_flagged", 0)),
                     fmt(s.get("n_unspecified", 0)),
                     f"{fmt(s.get('n_failed_labels', 0))} ({fmt(s.get('n_cut_labels', 0))})",
                     fmt(s.get("n_repaired_labels", 0)),
                     fmt(s.get("min_label_coverage")), fmt(s.get("n_low_coverage_trials", 0)),
                     f"{fmt(s.get('n_supervisor_failed_rounds', 0))} ({fmt(s.get('n_trials_supervisor_failed', 0))}; "
                     f"{fmt(s.get('n_supervisor_cut_rounds', 0))} cut)",
                     cut_text((usage or {}).get(run.key, {})),
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


def compute_table_ctx(runs: list[RunData], usage: dict[str, dict[str, dict[str, float]]]) -> dict[str, Any]:
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
    return _t(cols, rows, _num(cols, 2))


def usage_frame(runs: list[RunData], usage: dict[str, dict[str, dict[str, float]]]) -> pd.DataFrame:
    """tables/usage_by_role.csv: one row per run and role."""
    recs = [{"run": run.key, "role": role, **u} for run in runs for role, u in usage.get(run.key, {}).items()]
    return pd.DataFrame(recs, columns=["run", "role", "requests", "prompt_tokens", "completion_tokens",
                                       "cached_tokens", "latency_s", "cut_calls", "cut_answers"])


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


PAIRED_NAMES = {"deception_rate": "deception rate", "severity_average_all_rounds": "avg severity (all rounds)",
                "severity_deceptive_nan": "avg severity (deceptive; trials with a flag)"}
PAIRED_HOW = ("difference run − base over paired seeds; 95 % paired-t interval (read this one) and BCa bootstrap; "
              "sign-flip permutation test (exact up to 16 seeds); sign test as a robustness line; the minimal "
              "detectable difference (MDD) is the true difference a two-sided 0.05 t-test finds with 80 % power at "
              "this many seeds and this spread")


def paired_table_ctx(effects: pd.DataFrame, labels: dict[str, str]) -> dict[str, Any]:
    """One row per (run against the base, auditor, metric): `metrics.paired.paired_effect`."""
    cols = ["run (against the base)", "base", "scored by", "metric", "paired seeds (dropped: undefined)", "base mean",
            "run mean", "mean difference (run − base)", "95% CI (paired t)", "95% CI (BCa bootstrap)",
            "permutation p (sign flips)", "seeds up / down / tied", "sign test p", "SD of differences",
            "MDD (80 % power)", "verdict"]
    rows = [[labels.get(r["other"], r["other"]), labels.get(r["base"], r["base"]), str(r.get("auditor", "")),
             PAIRED_NAMES.get(r["metric"], r["metric"]), f"{fmt(r['n_pairs'])} ({fmt(r['n_undefined'])})",
             fmt(r["mean_base"]), fmt(r["mean_other"]), signed(r["mean_diff"], 3), ci(r["ci_low"], r["ci_high"]),
             ci(r["bca_low"], r["bca_high"]), fmt(r["perm_p"], 4), f"{r['n_up']} / {r['n_down']} / {r['n_zero']}",
             fmt(r["sign_p"], 4), fmt(r["sd_diff"]), fmt(r["mdd"]), r["verdict"]]
            for r in effects.to_dict("records")]
    return _t(cols, rows, [False] * 4 + [True] * 11 + [False])


def paired_md(paired: Sequence[PairedComparison], warnings: Sequence[str] = ()) -> list[str]:
    """The paired comparison with the base run (and with a held-out auditor), as summary.md lines;
    the adapter warnings first (`report.adapter_checks`)."""
    if not paired:
        return []
    lines = ["", f"Paired by seed against the base run {paired[0].base} ({PAIRED_HOW}; fewer than {MIN_PAIRS} "
             "paired seeds is too few to tell):", ""]
    lines += [f"- WARNING: {w}" for w in warnings]
    seen: set[tuple[str, str]] = set()
    for c in paired:
        for r in c.effects.to_dict("records"):
            lines.append(f"- {c.other}, {r['metric']}, scored by {r.get('auditor')}: {r['n_pairs']} paired seeds "
                         f"({r['n_undefined']} dropped, undefined), {fmt(r['mean_base'])} → {fmt(r['mean_other'])}, "
                         f"difference {signed(r['mean_diff'], 3)} {ci(r['ci_low'], r['ci_high'])} (paired t; BCa "
                         f"{ci(r['bca_low'], r['bca_high'])}), permutation p {fmt(r['perm_p'], 4)}, seeds up/down/tied "
                         f"{r['n_up']}/{r['n_down']}/{r['n_zero']}, sign test p {fmt(r['sign_p'], 4)}, MDD "
                         f"{fmt(r['mdd'])}: {r['verdict']}")
        lines += [f"- {c.other}: {n}" for n in c.notes if (c.other, n) not in seen]
        seen |= {(c.other, n) for n in c.notes}
    return lines


def paired_trials_ctx(trials: pd.DataFrame) -> dict[str, Any]:
    """Per trial of one comparison: its pairing status and the per-seed rate and severity."""
    cols = ["trial", "seed", "pairing", "rate (base)", "rate (run)", "difference",
            "avg severity all (base)", "avg severity all (run)", "difference"]
    rows = [[r["trial_id"], fmt(r["seed"], 0), r["status"], fmt(r["deception_rate_base"]),
             fmt(r["deception_rate_other"]), signed(r["deception_rate_diff"], 3),
             fmt(r["severity_average_all_rounds_base"], 2), fmt(r["severity_average_all_rounds_other"], 2),
             signed(r["severity_average_all_rounds_diff"], 3)] for r in trials.to_dict("records")]
    return _t(cols, rows, [False, True, False, True, True, True, True, True, True])
