"""The public API that code outside lhd's stages builds on (the `lens` package, notebooks,
scripts): a run directory and its records, the labels of its rounds, its task packs and texts,
and the numeric facts of a pack's files.

Like tuned-lens depends on nothing above it, `lens/` imports from `lhd_train` only this module,
`lhd_train.errors` and the neutral file toolkit `lhd_train.io` (`tests/test_layout.py` holds the
list); its commands are lhd's (`lhd_train/cli/lens.py`). A name added here is a promise to keep it
stable."""
from __future__ import annotations

from lhd_train.audit.trajectory import TaskText, load_task_texts
from lhd_train.bench.facts import Fact, different_number, extract_facts
from lhd_train.bench.taskpack import TaskPack, load_pack
from lhd_train.errors import DataFileError, InputError, LhdError
from lhd_train.metrics.labels import RoundLabel, round_labels
from lhd_train.rundir.manifest import Manifest
from lhd_train.rundir.rows import AuditRow, RoundRow
from lhd_train.rundir.run import Run

__all__ = [
    "AuditRow", "DataFileError", "Fact", "InputError", "LhdError", "Manifest", "RoundLabel", "RoundRow", "Run",
    "TaskPack", "TaskText", "different_number", "extract_facts", "load_pack", "load_task_texts", "round_labels",
]
