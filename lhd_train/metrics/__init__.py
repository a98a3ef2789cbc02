"""Metrics of the LH-Deception benchmark (docs/reference.md) and our additions; definitions in
docs/metrics.md. Modules: `labels` (the public labels API: the headline auditor's label of each
round), `load` (a run directory as tables, with one auditor's labels), `registry` (the trial
metrics, `@trial_metric`, and their `MetricSummary` across trials), `core` (every table of a
report), `horizon` (long vs short auditors, delayed deceptions, chains), `paired` and
`paired_stats` (an adapter's effect, paired by seed) and `correction` (a rate corrected for the
auditor's measured errors)."""
from lhd_train.metrics.core import compute_all, per_trial_table, trial_stats
from lhd_train.metrics.labels import RoundLabel, round_labels
from lhd_train.metrics.load import RunData, load_audit, load_run, load_runs
from lhd_train.metrics.registry import METRICS, MetricSummary, TrialMetric, trial_metric

__all__ = ["METRICS", "MetricSummary", "RoundLabel", "RunData", "TrialMetric", "compute_all", "load_audit",
           "load_run", "load_runs", "per_trial_table", "round_labels", "trial_metric", "trial_stats"]
