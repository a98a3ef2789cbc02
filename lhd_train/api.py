"""The public API that code outside lhd's stages builds on (the `lens` package, notebooks,
scripts): a run directory and its records, the labels of its rounds, its task texts, the lock
and output rules that keep a reader from writing into a run.

Like tuned-lens depends on nothing above it, `lens/` imports from `lhd_train` only this module,
`lhd_train.errors` and the neutral file toolkit `lhd_train.io` (its commands also use the one
error boundary and the settings bridge; `tests/test_layout.py` holds the list). A name added
here is a promise to keep it stable."""
from __future__ import annotations

from lhd_train.audit.trajectory import TaskText, load_task_texts
from lhd_train.bench.taskpack import TaskPack, load_pack
from lhd_train.errors import DataFileError, InputError, LhdError
from lhd_train.metrics.labels import RoundLabel, round_labels
from lhd_train.rundir.lock import run_dir_lock
from lhd_train.rundir.manifest import Manifest
from lhd_train.rundir.outputs import check_out_dir
from lhd_train.rundir.rows import AuditRow, RoundRow
from lhd_train.rundir.run import Run
from lhd_train.rundir.shard import parse_shard, shard_bounds

__all__ = [
    "AuditRow", "DataFileError", "InputError", "LhdError", "Manifest", "RoundLabel", "RoundRow", "Run", "TaskPack",
    "TaskText", "check_out_dir", "load_pack", "load_task_texts", "parse_shard", "round_labels", "run_dir_lock",
    "shard_bounds",
]
