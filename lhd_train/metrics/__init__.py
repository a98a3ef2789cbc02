"""Metrics of the LH-Deception benchmark (docs/reference.md) and our additions.

Definitions are written in docs/metrics.md. Entry points: `round_labels` (the public labels API,
`metrics.labels`: the headline auditor's label of each round), `load_run`/`load_runs` (tables of a
run directory with one auditor's labels), `trial_stats` (per trial, exactly as the reference),
`compute_all` (every table of a report), and the horizon metrics (`compare_auditors`,
`delayed_rounds`, `deception_chains`)."""
from lhd_train.metrics.core import (
    RunMetrics,
    TrialStats,
    bootstrap_ci,
    breakdown,
    compute_all,
    control_table,
    correlations_across,
    correlations_within,
    mean_se,
    pearson,
    per_trial_table,
    summarize,
    summary_table,
    trial_stats,
    type_distribution,
)
from lhd_train.metrics.horizon import (
    Chain,
    RoundFlag,
    chains_summary,
    chains_table,
    compare_auditors,
    deception_chains,
    delayed_rounds,
    delayed_table,
    horizon_table,
    undetermined_rounds,
)
from lhd_train.metrics.labels import (
    AuditorInfo,
    RoundLabel,
    headline_auditor,
    list_auditors,
    pick_auditor,
    round_labels,
)
from lhd_train.metrics.load import (
    RunData,
    load_audit,
    load_run,
    load_runs,
    trial_condition,
)

__all__ = [
    "AuditorInfo", "Chain", "RoundFlag", "RoundLabel", "RunData", "RunMetrics", "TrialStats", "bootstrap_ci",
    "breakdown", "chains_summary", "chains_table", "compare_auditors", "compute_all", "control_table",
    "correlations_across", "correlations_within", "deception_chains", "delayed_rounds", "delayed_table",
    "headline_auditor", "horizon_table", "list_auditors", "load_audit", "load_run", "load_runs", "mean_se", "pearson",
    "per_trial_table", "pick_auditor", "round_labels", "summarize", "summary_table", "trial_condition", "trial_stats",
    "type_distribution", "undetermined_rounds",
]
