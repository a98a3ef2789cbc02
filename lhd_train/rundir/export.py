"""`lhd export RUN --out DIR`: a run as a Hugging Face `datasets` dataset, one row per round.

Columns are flat scalars (plus a few lists: token ids, types, evidence) with a fixed schema, so
datasets from different runs (ours or imported) concatenate and a column that is null in one run
keeps its type. Every auditor found under `audit/` adds its labels as `<auditor-id>__<field>`."""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lhd_train.errors import InputError
from lhd_train.rundir.files import read_json_mapping
from lhd_train.rundir.layout import RunDir, TrialFiles
from lhd_train.rundir.store import MessageStore, read_audit_rows, read_trial_rows

AUDIT_FIELDS: tuple[tuple[str, str], ...] = (
    ("deceptive", "bool"), ("types", "list[str]"), ("severity", "int64"), ("confidence", "float64"),
    ("reasoning", "string"), ("evidence", "list[str]"), ("parse_status", "string"),
)
SEP = "__"


def _get(row: dict[str, Any], *path: str) -> Any:
    cur: Any = row
    for p in path:
        if not isinstance(cur, dict):
            return None
        cur = cur.get(p)
    return cur


def _g(*path: str) -> Callable[[dict[str, Any]], Any]:
    return lambda row: _get(row, *path)


# (column, type, getter). Types: string, int64, float64, bool, list[int], list[str].
ROUND_COLUMNS: list[tuple[str, str, Callable[[dict[str, Any]], Any]]] = [
    ("run_id", "string", _g("run_id")),
    ("trial_id", "string", _g("trial_id")),
    ("seed", "int64", _g("seed")),
    ("pack", "string", _g("pack")),
    ("task_index", "int64", _g("task_index")),
    ("task_title", "string", _g("task_title")),
    ("round", "int64", _g("round")),
    ("global_round", "int64", _g("global_round")),
    ("has_event", "bool", lambda r: r.get("event") is not None),
    ("event_name", "string", _g("event", "name")),
    ("event_category", "string", _g("event", "category")),
    ("event_pressure", "string", _g("event", "pressure")),
    ("event_content", "string", _g("event", "content")),
    ("performer_text", "string", _g("performer", "text")),
    ("performer_think", "string", _g("performer", "think")),
    ("performer_finish_reason", "string", _g("performer", "finish_reason")),
    ("performer_token_ids", "list[int]", _g("performer", "token_ids")),
    ("performer_prompt_tokens", "int64", _g("performer", "prompt_tokens")),
    ("performer_completion_tokens", "int64", _g("performer", "completion_tokens")),
    ("performer_latency_s", "float64", _g("performer", "latency_s")),
    ("performer_attempts", "int64", _g("performer", "attempts")),
    ("performer_temperature", "float64", _g("performer", "sampling", "temperature")),
    ("performer_top_p", "float64", _g("performer", "sampling", "top_p")),
    ("performer_max_tokens", "int64", _g("performer", "sampling", "max_tokens")),
    ("performer_sampling_seed", "int64", _g("performer", "sampling", "seed")),
    ("performer_context_policy", "string", _g("performer", "context", "policy")),
    ("performer_context_dropped_messages", "int64", _g("performer", "context", "dropped_messages")),
    ("supervisor_evaluation_reasoning", "string", _g("supervisor", "evaluation", "reasoning")),
    ("supervisor_feedback_reasoning", "string", _g("supervisor", "feedback", "reasoning")),
    ("supervisor_feedback", "string", _g("supervisor", "feedback", "text")),
    ("supervisor_parse_status", "string", _g("supervisor", "parse_status")),
    ("supervisor_attempts", "int64", _g("supervisor", "attempts")),
    ("trust_before", "float64", _g("supervisor", "state_before", "trust")),
    ("satisfaction_before", "float64", _g("supervisor", "state_before", "satisfaction")),
    ("comfort_before", "float64", _g("supervisor", "state_before", "comfort")),
    ("trust_after", "float64", _g("supervisor", "state_after", "trust")),
    ("satisfaction_after", "float64", _g("supervisor", "state_after", "satisfaction")),
    ("comfort_after", "float64", _g("supervisor", "state_after", "comfort")),
    ("task_complete", "bool", _g("task_complete")),
    ("performer_model", "string", _g("models", "performer", "model")),
    ("performer_adapter", "string", _g("models", "performer", "adapter")),
    ("supervisor_model", "string", _g("models", "supervisor", "model")),
    ("timestamp", "string", _g("timestamp")),
]
EXTRA_COLUMNS = [("trial_finished", "bool"), ("performer_user_message", "string")]


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
    if kind == "string":
        return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    if kind == "list[int]":
        return [int(v) for v in value]
    if kind == "list[str]":
        return [v if isinstance(v, str) else json.dumps(v, ensure_ascii=False) for v in value]
    return value


def collect_rows(run_dir: Path) -> tuple[list[dict[str, Any]], dict[str, str], list[str]]:
    """Flat records for every round, their column types, and the auditor ids found."""
    run_dir = Path(run_dir)
    rd = RunDir(run_dir)
    if not rd.is_run():
        raise InputError(run_dir, None, "not a run directory (no trials/ folder)")
    audit_dir = rd.audit_dir
    auditors = rd.auditor_ids()
    for aid in auditors:
        if SEP in aid:
            raise InputError(audit_dir / aid, None, f"an auditor id containing {SEP!r} cannot be exported")
    types = {name: kind for name, kind, _ in ROUND_COLUMNS} | dict(EXTRA_COLUMNS)
    for aid in auditors:
        types |= {f"{aid}{SEP}{f}": kind for f, kind in AUDIT_FIELDS}

    records: list[dict[str, Any]] = []
    for path in rd.rows_files():
        tf = TrialFiles.from_rows(path)
        rows = sorted(read_trial_rows(path), key=lambda r: r["global_round"])
        if not rows:
            continue
        finished = tf.done.exists()
        store = MessageStore(tf.messages) if tf.messages.exists() else None
        labels = {}
        for aid in auditors:
            by_round = {r["global_round"]: r for r in read_audit_rows(rd.audit_rows(aid, tf.trial_id))}
            labels[aid] = by_round
        for row in rows:
            rec = {name: _cast(get(row), kind) for name, kind, get in ROUND_COLUMNS}
            rec["trial_finished"] = finished
            ids = _get(row, "performer", "new_message_ids") or []
            rec["performer_user_message"] = (
                "\n\n".join(m["content"] for m in store.get(ids))
                if store is not None and ids and all(i in store for i in ids) else None)
            for aid in auditors:
                a = labels[aid].get(row["global_round"]) or {}
                for f, kind in AUDIT_FIELDS:
                    rec[f"{aid}{SEP}{f}"] = _cast(a.get(f), kind)
            records.append(rec)
    if not records:
        raise InputError(rd.trials_dir, None, "the run has no rounds to export")
    return records, types, auditors


def export_run(run_dir: Path, out: Path) -> Any:
    """Write the dataset with `save_to_disk(out)` and return it. Run-level facts (the manifest's
    source, every auditor's settings) go into `info.description` as JSON."""
    from datasets import Dataset, Features

    run_dir = Path(run_dir)
    records, types, auditors = collect_rows(run_dir)
    features = Features({name: _feature(kind) for name, kind in types.items()})
    ds = Dataset.from_list(records, features=features)
    meta: dict[str, Any] = {"run_dir": str(run_dir.resolve()), "auditors": {}, "column_separator": SEP}
    rd = RunDir(run_dir)
    if rd.manifest.exists():
        m = read_json_mapping(rd.manifest)
        meta["run_id"] = m.get("run_id")
        meta["source"] = (m.get("source") or {}).get("kind", "lhd run")
    for aid in auditors:
        info_path = rd.auditor_info(aid)
        if info_path.exists():
            info = read_json_mapping(info_path)
            meta["auditors"][aid] = {k: info.get(k) for k in ("options", "model_identity", "role")}
    ds.info.description = json.dumps(meta, ensure_ascii=False)
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not (out / "dataset_info.json").exists():
        raise InputError(out, None, "exists and is not a dataset folder; choose another --out")
    ds.save_to_disk(str(out))
    return ds
