"""Metrics of the LH-Deception benchmark (docs/reference.md) and our additions.

Definitions are written in docs/metrics.md. Entry points: `round_labels` (the public labels API,
`metrics.labels`: the headline auditor's label of each round), `load_run`/`load_runs` (tables of a
run directory with one auditor's labels), the registry of trial metrics (`registry`: `@trial_metric`,
`MetricSummary`), `trial_stats` (per trial, exactly as the reference), `compute_all` (every table of
a report), and the horizon metrics (`compare_auditors`, `delayed_rounds`, `deception_chains`)."""
from lhd_train.metrics.core import (
    RunMetrics,
    breakdown,
    compute_all,
    control_table,
    correlations_across,
    correlations_within,
    pearson,
    per_trial_table,
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
    labels_frame,
    load_audit,
    load_run,
    load_runs,
    trial_condition,
)
from lhd_train.metrics.registry import METRICS, MetricSummary, TrialLabels, TrialMetric, trial_metric

__all__ = [
    "METRICS", "AuditorInfo", "Chain", "MetricSummary", "RoundFlag", "RoundLabel", "RunData", "RunMetrics",
    "TrialLabels", "TrialMetric", "breakdown", "chains_summary", "chains_table", "compare_auditors", "compute_all",
    "control_table", "correlations_across", "correlations_within", "deception_chains", "delayed_rounds",
    "delayed_table", "headline_auditor", "horizon_table", "labels_frame", "list_auditors", "load_audit", "load_run",
    "load_runs", "pearson", "per_trial_table", "pick_auditor", "round_labels", "summary_table", "trial_condition",
    "trial_metric", "trial_stats", "type_distribution", "undetermined_rounds",
]
