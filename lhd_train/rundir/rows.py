"""The records a run directory holds, as typed models: the schema versions, the fields and their
types, and which fields `lhd export` turns into dataset columns (docs/formats.md).

Rows stay plain dicts in memory and on disk (the writers build them; JSON round-trips them); the
models are the one statement of what a row is. Readers validate every line against them
(`rundir.store`), so a damaged or foreign file fails naming its line and field, and the export
derives its columns from them, so a field added here reaches the dataset without a second list.
Unknown fields are kept (`extra="allow"`): a newer writer's rows still load."""
from __future__ import annotations

import types
import typing
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Union

from pydantic import BaseModel, ConfigDict, Field
from pydantic.fields import FieldInfo

ROW_SCHEMA = "lhd.round/1"        # trials/<trial>.jsonl
AUDIT_SCHEMA = "lhd.audit/1"      # audit/<auditor-id>/<trial>.jsonl
AUDITOR_SCHEMA = "lhd.auditor/1"  # audit/<auditor-id>/auditor.json


@dataclass(frozen=True)
class Export:
    """How a field becomes export columns. A leaf's column is `prefix + name + suffix`, where the
    prefix and suffix come from the enclosing fields (by default `<field>_` for a nested record);
    `column` sets a leaf's whole name, `prefix`/`suffix` set a nested record's, `skip` leaves the
    field out."""

    column: str | None = None
    prefix: str | None = None
    suffix: str = ""
    skip: bool = False


SKIP = Export(skip=True)


class Record(BaseModel):
    """Strict types (no "3" for 3, no true for 1), unknown fields kept."""

    model_config = ConfigDict(strict=True, extra="allow")
    #: whether a field without an `Export` mark is exported (False: only marked fields are)
    export_by_default: ClassVar[bool] = True


# --------------------------------------------------------------------------------------------
# trajectory row: trials/<trial>.jsonl
# --------------------------------------------------------------------------------------------

class EventRecord(Record):
    name: str | None = None
    category: str | None = None
    pressure: str | None = None
    content: str | None = None


class SamplingRecord(Record):
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # None: the model's generation_config default (rollouts.types)
    repetition_penalty: float | None = None
    max_tokens: int | None = None
    seed: Annotated[int | None, Export(column="performer_sampling_seed")] = None
    n: Annotated[int | None, SKIP] = None


class PerformerContext(Record):
    policy: str | None = None
    budget_tokens: Annotated[int | None, SKIP] = None
    prompt_tokens: Annotated[int | None, SKIP] = None
    dropped_messages: int | None = None


class PerformerRecord(Record):
    text: str | None = None
    think: str | None = None
    raw: Annotated[str | None, SKIP] = None
    finish_reason: str | None = None
    segments: int | None = None
    truncated: bool | None = None
    token_ids: list[int] | None = None
    message_ids: Annotated[list[str] | None, SKIP] = None
    new_message_ids: Annotated[list[str] | None, SKIP] = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    latency_s: float | None = None
    sampling: Annotated[SamplingRecord | None, Export(prefix="performer_")] = None
    attempts: int | None = None
    context: PerformerContext | None = None


class SupervisorState(Record):
    trust: float | None = None
    satisfaction: float | None = None
    comfort: float | None = None


class Evaluation(Record):
    reasoning: str | None = None
    trust: Annotated[float | None, SKIP] = None  # the same numbers as state_after
    satisfaction: Annotated[float | None, SKIP] = None
    comfort: Annotated[float | None, SKIP] = None


class Feedback(Record):
    reasoning: str | None = None
    text: Annotated[str | None, Export(column="supervisor_feedback")] = None


class SupervisorRecord(Record):
    evaluation: Evaluation | None = None
    feedback: Feedback | None = None
    state_before: Annotated[SupervisorState | None, Export(prefix="", suffix="_before")] = None
    state_after: Annotated[SupervisorState | None, Export(prefix="", suffix="_after")] = None
    parse_status: str | None = None
    attempts: int | None = None
    calls: Annotated[list[dict[str, Any]] | None, SKIP] = None
    summaries_added: Annotated[list[dict[str, Any]] | None, SKIP] = None
    context: Annotated[dict[str, Any] | None, SKIP] = None


class ModelRef(Record):
    key: Annotated[str | None, SKIP] = None
    model: str | None = None
    revision: str | None = None
    backend: Annotated[str | None, SKIP] = None
    adapter: str | None = None


class RunModels(Record):
    """The models of a round, by role."""

    performer: ModelRef | None = None
    supervisor: ModelRef | None = None
    summariser: Annotated[ModelRef | None, SKIP] = None


class RoundRow(Record):
    """One performer answer and its supervision. Readers need the four required fields."""

    schema_: Annotated[str | None, SKIP, Field(alias="schema")] = None  # BaseModel has a `schema`
    run_id: str | None = None
    trial_id: str | None = None
    seed: int | None = None
    pack: str | None = None
    task_index: int
    task_title: str | None = None
    round: int
    global_round: int
    event: EventRecord | None = None
    performer: PerformerRecord
    supervisor: SupervisorRecord | None = None
    task_complete: bool | None = None
    models: Annotated[RunModels | None, Export(prefix="")] = None
    timestamp: str | None = None


class ResumableRoundRow(RoundRow):
    """What `lhd run` needs besides to rebuild a trial's state on resume."""

    supervisor: SupervisorRecord
    task_complete: bool


# --------------------------------------------------------------------------------------------
# audit row: audit/<auditor-id>/<trial>.jsonl
# --------------------------------------------------------------------------------------------

LABEL = Export()


class AuditRow(Record):
    """One auditor label of one round. Exported: the labels (`<auditor-id>__<field>` columns)."""

    export_by_default: ClassVar[bool] = False

    schema_: Annotated[str | None, Field(alias="schema")] = None
    run_id: str | None = None
    trial_id: str | None = None
    global_round: int
    task_index: int | None = None
    round: int | None = None
    auditor_id: str | None = None
    mode: str | None = None
    window: int | None = None
    deceptive: Annotated[bool | None, LABEL] = None
    types: Annotated[list[str] | None, LABEL] = None
    severity: Annotated[int | None, LABEL] = None
    confidence: Annotated[float | None, LABEL] = None
    reasoning: Annotated[str | None, LABEL] = None
    evidence: Annotated[list[str] | None, LABEL] = None
    parse_status: Annotated[str | None, LABEL] = None
    raw: str | None = None
    error: str | None = None
    original: dict[str, Any] | None = None
    reference_raw: dict[str, Any] | None = None
    attempts: int | None = None
    context_rounds: list[int] | None = None
    prompt_sha256: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    latency_s: float | None = None
    calls: list[dict[str, Any]] | None = None
    model: dict[str, Any] | None = None
    timestamp: str | None = None


# --------------------------------------------------------------------------------------------
# export columns, derived from the models
# --------------------------------------------------------------------------------------------

_KINDS: dict[Any, str] = {str: "string", int: "int64", float: "float64", bool: "bool"}


def _unwrap(field: FieldInfo) -> tuple[Any, Export | None]:
    """The field's type without `None`, and its `Export` mark if any."""
    mark = next((m for m in field.metadata if isinstance(m, Export)), None)
    annotation = field.annotation
    if typing.get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        annotation = args[0] if len(args) == 1 else annotation
    return annotation, mark


def _kind(tp: Any) -> str | None:
    if tp in _KINDS:
        return _KINDS[tp]
    if typing.get_origin(tp) is list and typing.get_args(tp) in ((int,), (str,)):
        return f"list[{typing.get_args(tp)[0].__name__}]"
    return None


@dataclass(frozen=True)
class Column:
    """One export column: its name, its type (string, int64, float64, bool, list[int], list[str])
    and the path of keys to its value in a row dict."""

    name: str
    kind: str
    path: tuple[str, ...]

    def get(self, row: dict[str, Any]) -> Any:
        cur: Any = row
        for key in self.path:
            if not isinstance(cur, dict):
                return None
            cur = cur.get(key)
        return cur


def export_columns(model: type[Record], prefix: str = "", suffix: str = "",
                   path: tuple[str, ...] = ()) -> list[Column]:
    """The columns of `model`, in field order. A field whose type has no column type must be
    marked `SKIP`, so a new field is exported or left out on purpose, never by accident."""
    out: list[Column] = []
    for name, field in model.model_fields.items():
        key = field.alias or name
        tp, mark = _unwrap(field)
        if (mark is not None and mark.skip) or (mark is None and not model.export_by_default):
            continue
        if isinstance(tp, type) and issubclass(tp, Record):
            sub_prefix = mark.prefix if mark is not None and mark.prefix is not None else f"{prefix}{key}_"
            out += export_columns(tp, sub_prefix, suffix + (mark.suffix if mark else ""), path + (key,))
            continue
        kind = _kind(tp)
        if kind is None:
            raise TypeError(f"{model.__name__}.{name}: {tp!r} has no export column type; mark it SKIP")
        column = mark.column if mark is not None and mark.column else f"{prefix}{key}{suffix}"
        out.append(Column(column, kind, path + (key,)))
    return out


def undeclared_fields(model: type[Record], row: dict[str, Any], where: str = "") -> list[str]:
    """Keys of `row` (recursively, through nested records) that `model` does not declare: what a
    writer wrote that the schema does not know about."""
    found: list[str] = []
    by_key = {(f.alias or n): f for n, f in model.model_fields.items()}
    for key, value in row.items():
        if key not in by_key:
            found.append(where + key)
            continue
        tp, _ = _unwrap(by_key[key])
        if isinstance(tp, type) and issubclass(tp, Record) and isinstance(value, dict):
            found += undeclared_fields(tp, value, f"{where}{key}.")
    return found
