"""Post-hoc deception auditing of finished trials (docs/auditing.md).

`audit_run` labels every round of a run with one auditor (full, window, causal or task mode);
`make_consistent` is the one place where contradictory labels are repaired. The labels are read
back through the run directory (`Run.open(run).auditor(id).labels(trial)`), the auditors of a
run with `lhd_train.metrics.list_auditors`."""
from lhd_train.audit.labels import AuditAnswer, Labels, make_consistent
from lhd_train.audit.runner import AuditSummary, audit_run
from lhd_train.audit.trajectory import build_messages, context_indices, window_bounds

__all__ = [
    "AuditAnswer", "Labels", "make_consistent", "AuditSummary", "audit_run", "build_messages", "context_indices",
    "window_bounds",
]
