"""The records of the folders `lhd data` and `lhd train` write, as typed models like the run
directory's (`rundir.manifest`): a dataset folder's `dataset.json` (and the same record inside the
data folder as `lhd_data.json`, so a data folder named alone in a recipe still says what it is)
and an adapter folder's `lhd_adapter.json`.

One writer and one reader each. Fields every writer has written since the first version are
required; collections default to empty; unknown fields are kept. tests/data/records/ holds files
written before these models, which still read."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pydantic import Field

from lhd_train.rundir.rows import Record
from lhd_train.rundir.run import read_record, write_record

DATA_DIR = "dataset"  # <out>/dataset/: the saved DatasetDict
DATA_RECORD = "dataset.json"  # <out>/dataset.json
DATA_SIDECAR = "lhd_data.json"  # <out>/dataset/lhd_data.json: the same record, inside the data
ADAPTER_RECORD = "lhd_adapter.json"  # <output_dir>/adapter/lhd_adapter.json
ADAPTER_SCHEMA = "lhd.adapter/1"


class AuditorIdentity(Record):
    """One auditor whose labels selected or rewarded training data (`finetune.lineage`)."""

    role: str
    auditor_id: str | None
    key: str | None
    model: str | None


# ----------------------------------------------------------------------------- a dataset folder


class RunAudit(Record):
    """Whose audit labels of the run the data carries (best-of-N and DPO add how the grader's
    verdicts on the original answers compare with them: `datasets.audit_agreement`)."""

    auditor_id: str | None


class DataPart(Record):
    """One dataset a merge joined (`lhd data merge`)."""

    path: str
    run: str | None
    rows: dict[str, int]
    stats: dict[str, Any] = Field(default_factory=dict)


class DataRecord(Record):
    """dataset.json / lhd_data.json: what a dataset was built from and how (docs/training.md). The
    builders add their settings and provenance (n, grader_id, on_task_min, min_margin, performer,
    contexts_left_out, packages), kept as they were written."""

    kind: str  # bon-sft, dpo, grpo-prompts
    direction: str
    rows: dict[str, int]  # split -> rows
    sha256: str  # over the rows of every split
    run_audit: RunAudit
    run: str | None = None  # the run it was built from (a merge names its parts instead)
    parts: list[DataPart] = Field(default_factory=list)
    auditors: list[AuditorIdentity] = Field(default_factory=list)  # empty in data made before lineage
    stats: dict[str, Any] = Field(default_factory=dict)
    auditor: dict[str, Any] = Field(default_factory=dict)  # the grader's auditor config (best-of-N, DPO)


def write_data_record(out: Path, record: DataRecord) -> None:
    """`out/dataset.json`, and the same record as `out/dataset/lhd_data.json`."""
    write_record(Path(out) / DATA_RECORD, record)
    write_record(Path(out) / DATA_DIR / DATA_SIDECAR, record)


def find_data_record(path: Path) -> tuple[DataRecord, Path] | None:
    """The record of the data at `path` (a data folder, or a file in one) and where it was found:
    the folder's own lhd_data.json, else the dataset.json beside the folder (a merge made before
    merges wrote lhd_data.json) or in it. None when there is none; a `DataFileError` naming the
    file and field when one is not a dataset record."""
    folder = Path(path) if Path(path).is_dir() else Path(path).parent
    for where in (folder / DATA_SIDECAR, folder.parent / DATA_RECORD, folder / DATA_RECORD):
        record = read_record(where, DataRecord)
        if record is not None:
            return record, where
    return None


def read_data_record(out: Path) -> DataRecord | None:
    """`out/dataset.json` of a dataset folder `lhd data` wrote (None when there is none)."""
    return read_record(Path(out) / DATA_RECORD, DataRecord)


# ----------------------------------------------------------------------------- an adapter folder


class DataLineage(Record):
    """The lineage of one split: its runs, trial seeds and auditors, and what was not found."""

    path: str
    kind: str | None
    runs: list[str] = Field(default_factory=list)
    run_ids: list[str] = Field(default_factory=list)
    trials: dict[str, int] = Field(default_factory=dict)
    seeds: list[int] = Field(default_factory=list)
    auditors: list[AuditorIdentity] = Field(default_factory=list)
    missing: list[str] = Field(default_factory=list)


class AdapterLineage(Record):
    """What trained an adapter: every split's lineage joined, plus the reward judges (GRPO)."""

    runs: list[str] = Field(default_factory=list)
    train_seeds: list[int] = Field(default_factory=list)
    eval_seeds: list[int] = Field(default_factory=list)
    train_trials: dict[str, int] = Field(default_factory=dict)
    auditors: list[AuditorIdentity] = Field(default_factory=list)
    missing: list[str] = Field(default_factory=list)


class SplitInfo(Record):
    """One split as `lhd train` read and fitted it (lhd_adapter.json `data.<split>`)."""

    path: str
    split: str | None  # the DatasetDict split; None for a JSONL file
    rows: int  # after fitting to the trainer's length
    rows_read: int
    format: str  # the algorithm's format (`config.algos.Format.name`)
    sha256: str
    files: list[dict[str, Any]] = Field(default_factory=list)
    lineage: DataLineage | None = None  # None in adapters trained before lineage
    length_fit: dict[str, Any] | None = None  # `fit_rows.FitReport`
    rows_trained: int | None = None  # what TRL kept


class TrainingInfo(Record):
    global_step: int
    max_steps: int
    epoch: float | None
    resumed_from: str | None
    start_step: int
    device: str
    world_size: int
    adjustments: list[str]
    trainer_args: dict[str, Any]
    accelerate_config: str | None
    seconds: float


class AdapterRecord(Record):
    """lhd_adapter.json: an adapter's base, recipe, data, lineage, training and versions. Written
    last (after log_history.json): its presence says the adapter is trained."""

    schema_: Annotated[str, Field(alias="schema")]
    algo: str
    direction: str
    base_model: str
    base_revision: str | None
    base_commit: str | None
    tokenizer: str
    dtype: str
    recipe_path: str | None
    recipe: dict[str, Any]
    data: dict[str, SplitInfo]
    sft_loss_on: str | None
    lora: dict[str, Any]
    training: TrainingInfo
    metrics: dict[str, Any]
    versions: dict[str, str]
    started_at: str
    finished_at: str
    lineage: AdapterLineage | None = None  # None in adapters trained before lineage


def write_adapter_record(adapter: Path, record: AdapterRecord) -> None:
    write_record(Path(adapter) / ADAPTER_RECORD, record)


def read_adapter_record(adapter: Path) -> AdapterRecord | None:
    """`<adapter>/lhd_adapter.json` (None when there is none; a `DataFileError` naming the file and
    field when it is not an adapter record)."""
    return read_record(Path(adapter) / ADAPTER_RECORD, AdapterRecord)
