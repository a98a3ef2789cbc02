"""`lhd export RUN --out DIR`: a run as a Hugging Face `datasets` dataset, one row per round.

Columns are flat with a fixed schema derived from the row models in `rundir.rows` (so datasets of
different runs concatenate), plus four computed ones and each auditor's labels as
`<auditor-id>__<field>` (the row that counts: `AuditorStore.labels`). Trials are held against their
`.done` markers, a run being written is read up to its last whole line, a missing user message is
flagged (`performer_user_message_missing`), and the dataset is built aside and swapped in
(`rundir.staging`). docs/auditing.md, "`lhd export RUN --out DIR`"."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lhd_train.errors import InputError
from lhd_train.io.files import printable
from lhd_train.rundir.outputs import check_out_dir
from lhd_train.rundir.rows import AuditRow, Column, RoundRow, export_columns
from lhd_train.rundir.run import Run
from lhd_train.rundir.staging import staged_dir

SEP = "__"

#: columns that are not a row field: computed from the row, the trial or its message store
COMPUTED_COLUMNS = [("has_event", "bool"), ("trial_finished", "bool"), ("performer_user_message", "string"),
                    ("performer_user_message_missing", "bool")]


def round_columns() -> list[Column]:
    """The row's columns (from `RoundRow`), with `has_event` before the event's own."""
    cols = export_columns(RoundRow)
    at = next(i for i, c in enumerate(cols) if c.path[0] == "event")
    return cols[:at] + [Column("has_event", "bool", ())] + cols[at:]


AUDIT_COLUMNS = export_columns(AuditRow)


def _feature(kind: str) -> Any:
    from datasets import Sequence, Value

    return {"string": Value("string"), "int64": Value("int64"), "float64": Value("float64"), "bool": Value("bool"),
            "list[int]": Sequence(Value("int64")), "list[str]": Sequence(Value("string"))}[kind]


def _cast(value: Any, kind: str) -> Any:
    """Coerce to the column type so one odd row (an int where a float is usual) cannot break it."""
    if value is None:
        return None
    if kind == "float64":
        return float(value)
    if kind == "int64":
        return int(value)
    if kind == "bool":
        return bool(value)
    if kind == "string":  # Arrow strings are UTF-8: a lone surrogate shows as U+FFFD
        return printable(value if isinstance(value, str) else json.dumps(value, ensure_ascii=False))
    if kind == "list[int]":
        return [int(v) for v in value]
    if kind == "list[str]":
        return [printable(v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)) for v in value]
    return value


def collect_rows(run_dir: Path | Run) -> tuple[list[dict[str, Any]], dict[str, str], list[str]]:
    """Flat records for every round, their column types, and the auditor ids found (those with
    rows). A round labelled twice by one auditor exports the row that counts (`AuditorStore.labels`)."""
    run = run_dir if isinstance(run_dir, Run) else Run.open(run_dir)
    rd = run.dir
    audit_dir = rd.audit_dir
    auditors = run.auditor_ids()
    for aid in auditors:
        if SEP in aid:
            raise InputError(audit_dir / aid, None, f"an auditor id containing {SEP!r} cannot be exported")
    columns = round_columns()
    types = {c.name: c.kind for c in columns} | dict(COMPUTED_COLUMNS)
    for aid in auditors:
        types |= {f"{aid}{SEP}{c.name}": c.kind for c in AUDIT_COLUMNS}

    records: list[dict[str, Any]] = []
    for trial in run.trials():
        rows, finished = trial.read(RoundRow)  # a cut finished trial is an error
        rows.sort(key=lambda r: r.global_round)
        if not rows:
            continue
        store = trial.messages() if trial.files.messages.exists() else None
        labels: dict[str, dict[int, AuditRow]] = {aid: run.auditor(aid).labels(trial.trial_id) for aid in auditors}
        for row in rows:
            data = row.to_json()
            rec = {c.name: _cast(c.get(data), c.kind) for c in columns}
            rec["has_event"] = row.event is not None
            rec["trial_finished"] = finished
            ids = row.performer.new_message_ids
            found = store is not None and all(i in store for i in ids)
            rec["performer_user_message"] = _cast("\n\n".join(m["content"] for m in store.get(ids)), "string") \
                if ids and found and store is not None else None
            rec["performer_user_message_missing"] = bool(ids) and not found
            for aid in auditors:
                label = labels[aid].get(row.global_round)
                cells = label.to_json() if label is not None else {}
                for c in AUDIT_COLUMNS:
                    rec[f"{aid}{SEP}{c.name}"] = _cast(c.get(cells), c.kind)
            records.append(rec)
    if not records:
        raise InputError(rd.trials_dir, None, "the run has no rounds to export")
    return records, types, auditors


def export_run(run_dir: Path, out: Path) -> Any:
    """Write the dataset with `save_to_disk(out)` and return it. Run-level facts (the manifest's
    source, every auditor's settings) go into `info.description` as JSON."""
    from datasets import Dataset, Features

    run_dir, out = Path(run_dir), Path(out)
    check_out_dir(out, what="dataset")
    if out.exists() and any(out.iterdir()) and not (out / "dataset_info.json").exists():
        raise InputError(out, None, "exists and is not a dataset folder; choose another --out")
    run = Run.open(run_dir)
    records, types, auditors = collect_rows(run)
    features = Features({name: _feature(kind) for name, kind in types.items()})
    ds = Dataset.from_list(records, features=features)
    meta: dict[str, Any] = {"run_dir": str(run_dir.resolve()), "auditors": {}, "column_separator": SEP}
    manifest = run.manifest()
    if manifest is not None:
        meta["run_id"] = manifest.run_id
        meta["source"] = manifest.source.kind if manifest.source is not None else "lhd run"
    for aid in auditors:
        info = run.auditor(aid).record()
        if info is not None:
            meta["auditors"][aid] = {"options": info.options, "model_identity": info.model_identity,
                                     "role": info.role}
    meta["rounds_missing_user_message"] = sum(r["performer_user_message_missing"] for r in records)
    ds.info.description = json.dumps(meta, ensure_ascii=False)
    with staged_dir(out) as stage:  # a full disk or a kill leaves the old --out, never half a dataset
        ds.save_to_disk(str(stage))
    return ds
