"""The one door into a run directory: `Run.open(path)` and the typed records it reads and writes.

Every stage (run, audit, data, merge, report, lens, status) reads and writes a run directory
through `Run`, `TrialStore` and `AuditorStore`, with the records of `rundir.rows` and
`rundir.manifest`, never with paths or dict keys of its own. So each file of a run directory has
one reader and one writer, here; one rule says what a run directory is, which audit row of a
round counts and what a finished trial is (docs/formats.md)."""
from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar, overload

import yaml
from pydantic import ValidationError

from lhd_train.errors import DataFileError, InputError, data_file_error
from lhd_train.io.files import (
    append_jsonl,
    atomic_write_text,
    read_json_mapping,
    read_yaml_mapping,
    write_json_atomic,
)
from lhd_train.io.provenance import utc_now
from lhd_train.rundir.layout import RunDir, TrialFiles
from lhd_train.rundir.manifest import AuditorRecord, DoneMarker, Manifest, RunTasks, Summary
from lhd_train.rundir.rows import AuditRow, Record, RoundRow
from lhd_train.rundir.store import (
    MessageStore,
    check_done_marker,
    load_audit_rows,
    load_trial_rows,
    read_done_marker,
    winning_audit_rows,
)

M = TypeVar("M", bound=Record)
RR = TypeVar("RR", bound=RoundRow)


def read_record(path: Path, model: type[M]) -> M | None:
    """A run-level JSON record (`manifest.json`, `summary.json`, `auditor.json`, a `.done`
    marker) checked against its model; None when the file does not exist. A file that is not a
    JSON object of that shape is a `DataFileError` naming it and the field."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise DataFileError(path, f"not valid JSON ({e})") from None
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise data_file_error(e, path, root=model) from None


def write_record(path: Path, record: Record) -> None:
    """Replace a run-level JSON record atomically (a crash leaves the old file or the new one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, record.to_json())


class TrialStore:
    """One trial's files: its rows, its message store and its `.done` marker."""

    def __init__(self, files: TrialFiles):
        self.files = files

    @property
    def trial_id(self) -> str:
        return self.files.trial_id

    def exists(self) -> bool:
        return self.files.rows.exists()

    @overload
    def rows(self) -> list[RoundRow]: ...
    @overload
    def rows(self, model: type[RR]) -> list[RR]: ...
    def rows(self, model: type[RoundRow] = RoundRow) -> list[Any]:
        """The trial's rows, checked (`store.load_trial_rows`) and held against its `.done` marker
        like `read`; [] before its first round."""
        return self.read(model)[0]

    @overload
    def read(self) -> tuple[list[RoundRow], bool]: ...
    @overload
    def read(self, model: type[RR]) -> tuple[list[RR], bool]: ...
    def read(self, model: type[RoundRow] = RoundRow) -> tuple[list[Any], bool]:
        """The rows and whether the trial is finished, safe beside a writer: the marker is looked at
        before the rows are read (it is written after the last row), so a trial finishing while it
        is read is never taken for one whose rows were cut."""
        marked = self.files.done.exists()
        rows = load_trial_rows(self.files.rows, model)
        return rows, check_done_marker(self.files.done, self.files.rows, rows) if marked else False

    def finished(self) -> bool:
        """Marked finished, with a marker that agrees with the rows."""
        return self.read()[1]

    def done_marker(self) -> DoneMarker | None:
        return read_done_marker(self.files.done)

    def append(self, row: RoundRow) -> None:
        """Write one finished round (one line, fsynced)."""
        append_jsonl(self.files.rows, row.to_json())

    def mark_done(self, rows: list[RR], finished_at: str | None = None) -> None:
        """Mark the trial finished with the number of rounds it finished with. `finished_at`: when
        it finished (default now); a copy of a trial (a planted copy) keeps its original's."""
        write_record(self.files.done, DoneMarker(finished_at=finished_at or utc_now("auto"), rounds=len(rows),
                                                 last_global_round=rows[-1].global_round if rows else None))

    def messages(self) -> MessageStore:
        return MessageStore(self.files.messages)


class AuditorStore:
    """One auditor id's folder: `auditor.json` and one row file per trial."""

    def __init__(self, rd: RunDir, auditor_id: str):
        self.rd, self.auditor_id = rd, auditor_id

    @property
    def path(self) -> Path:
        return self.rd.auditor_dir(self.auditor_id)

    def record(self) -> AuditorRecord | None:
        return read_record(self.rd.auditor_info(self.auditor_id), AuditorRecord)

    def write_record(self, record: AuditorRecord) -> None:
        write_record(self.rd.auditor_info(self.auditor_id), record)

    def trial_ids(self) -> list[str]:
        """Trials with a row file from this auditor, sorted."""
        return sorted(p.name.removesuffix(".jsonl") for p in self.row_files())

    def row_files(self) -> list[Path]:
        return sorted(self.path.glob("*.jsonl")) if self.path.is_dir() else []

    def rows(self, trial_id: str) -> list[AuditRow]:
        """Every row of the trial in file order, a round possibly more than once."""
        return load_audit_rows(self.rd.audit_rows(self.auditor_id, trial_id))

    def labels(self, trial_id: str) -> dict[int, AuditRow]:
        """The row that counts for each labelled round (`store.winning_audit_rows`)."""
        return winning_audit_rows(self.rows(trial_id))

    def append(self, row: AuditRow) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        append_jsonl(self.rd.audit_rows(self.auditor_id, row.trial_id), row.to_json())


class Run:
    """A run directory and its records. `Run.open` for one that must exist, `Run.at` for one a
    writer creates."""

    def __init__(self, path: str | Path):
        self.dir = RunDir(path)

    @property
    def path(self) -> Path:
        return self.dir.path

    def __repr__(self) -> str:
        return f"Run({str(self.path)!r})"

    def __fspath__(self) -> str:
        return str(self.path)

    @classmethod
    def at(cls, path: str | Path) -> Run:
        """A run directory that may not exist yet (a writer's)."""
        return cls(path)

    @classmethod
    def open(cls, path: str | Path, source: str | None = None, field: str | None = None) -> Run:
        """The one rule for "is this a run directory": a folder with a `trials/` folder. Anything
        else is an `InputError` naming the path (`source`/`field`: the flag or file that gave it)."""
        run = cls(path)
        if not run.dir.is_run():
            what = ("does not exist" if not run.path.exists() else
                    f"a report written by `lhd report`: it holds {run.dir.report_marker.name}"
                    if run.dir.is_report() else "has no trials/ folder")
            raise InputError(source or run.path, field, f"not a run directory ({what})",
                             "a folder written by `lhd run`, `lhd merge` or `lhd import-reference`")
        return run

    def is_run(self) -> bool:
        return self.dir.is_run()

    # run-level records
    def manifest(self) -> Manifest | None:
        return read_record(self.dir.manifest, Manifest)

    def write_manifest(self, manifest: Manifest) -> None:
        write_record(self.dir.manifest, manifest)

    def summary(self) -> Summary | None:
        return read_record(self.dir.summary, Summary)

    def write_summary(self, summary: Summary) -> None:
        write_record(self.dir.summary, summary)

    def config(self) -> dict[str, Any]:
        """The run's resolved config as written (`config.resolved.yaml`; {} when absent). A mapping:
        the typed `RunConfig` lives in `lhd_train.config`, above this layer."""
        return read_yaml_mapping(self.dir.config, "run config", missing_ok=True)

    def write_config(self, config: Mapping[str, Any]) -> None:
        """Write the resolved config (`config.resolved.yaml`, the one writer: `lhd run` gives it
        `RunConfig.model_dump(mode="json")`) atomically, keys in the order given, so a config read
        by `config()` and written back (a planted copy) is the same file."""
        self.dir.path.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.dir.config, yaml.safe_dump(dict(config), sort_keys=False))

    def tasks(self) -> RunTasks | None:
        """The exact task texts the run carries (`tasks.json`: imported, curated and planted runs);
        None when it reads them from its pack."""
        return read_record(self.dir.tasks, RunTasks)

    def write_tasks(self, tasks: RunTasks) -> None:
        write_record(self.dir.tasks, tasks)

    def schedule(self, trial_id: str) -> dict[str, Any] | None:
        """A trial's saved event schedule (`schedules/<trial>.json`), None when it has none."""
        path = self.dir.schedule(trial_id)
        return read_json_mapping(path) if path.is_file() else None

    def schedule_ids(self) -> list[str]:
        """Trials with a saved schedule, sorted by name (a trial not started yet has one too)."""
        d = self.dir.schedules_dir
        return sorted(p.name.removesuffix(".json") for p in d.glob("*.json")) if d.is_dir() else []

    def write_schedule(self, trial_id: str, schedule: dict[str, Any]) -> None:
        """Save a trial's event schedule (drawn before any model call), atomically."""
        self.dir.schedules_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.dir.schedule(trial_id), schedule)

    # trials
    def trial_ids(self) -> list[str]:
        """Trials with a trajectory file or a `.done` marker, in the manifest's order when it has
        one, else by name. A marker whose rows are gone keeps its trial listed, so every reader
        meets it (`TrialStore.read` refuses it, naming the repair) instead of dropping the trial."""
        found = sorted({*self.dir.trial_ids(), *self.dir.done_trial_ids()})
        manifest = self.manifest() if self.dir.manifest.is_file() else None
        rank = {t: i for i, t in enumerate(manifest.trials if manifest else [])}
        return sorted(found, key=lambda t: (rank.get(t, len(rank)), t))

    def trial(self, trial_id: str) -> TrialStore:
        return TrialStore(self.dir.trial(trial_id))

    def trials(self) -> Iterator[TrialStore]:
        for tid in self.trial_ids():
            yield self.trial(tid)

    # auditors
    def auditor_ids(self) -> list[str]:
        """Auditor ids with at least one row file, sorted by name."""
        return [a for a in self.dir.auditor_ids() if self.auditor(a).row_files()]

    def auditor(self, auditor_id: str) -> AuditorStore:
        return AuditorStore(self.dir, auditor_id)
