"""The rows a run directory holds, as typed models: the in-memory type and the file format at once
(docs/formats.md, "The records are the types"), their schema versions, and which fields `lhd export`
turns into columns.

Writers build a `RoundRow` / `AuditRow` and `rundir.run` writes only the fields they set; readers
validate every line, so a damaged file fails naming its line and field. Unknown fields are kept;
older schema versions are upgraded on read (`upgrade`). Fields every writer always wrote are
required; collections are empty when absent or null (`Items`, `Table`); the rest stay optional."""
from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, TypeVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    PrivateAttr,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)
from pydantic.fields import FieldInfo

from lhd_train.errors import unwrap_optional

ROW_SCHEMA = "lhd.round/1"        # trials/<trial>.jsonl
AUDIT_SCHEMA = "lhd.audit/1"      # audit/<auditor-id>/<trial>.jsonl
AUDITOR_SCHEMA = "lhd.auditor/1"  # audit/<auditor-id>/auditor.json
#: every schema version a row file may hold, oldest first; a version added here needs an upgrade
#: step in `UPGRADES` and a fixture run directory under tests/data/runs/
ROW_SCHEMAS = (ROW_SCHEMA,)
AUDIT_SCHEMAS = (AUDIT_SCHEMA,)


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


T = TypeVar("T")
#: A collection in a record is empty, never None, when its writer left it out or wrote null (as
#: writers of the same schema did), so readers iterate it without a check.
Items = Annotated[list[T], BeforeValidator(lambda v: [] if v is None else v)]
Table = Annotated[dict[str, T], BeforeValidator(lambda v: {} if v is None else v)]


class Record(BaseModel):
    """Strict types (no "3" for 3, no true for 1), unknown fields kept, keyword construction by
    field name (`schema_=`) or by key (`schema=`)."""

    model_config = ConfigDict(strict=True, extra="allow", populate_by_name=True)
    #: whether a field without an `Export` mark is exported (False: only marked fields are)
    export_by_default: ClassVar[bool] = True

    #: the collections this record's file wrote as null: read as empty, written back as null, so a
    #: row copied from one file to another is written as it was
    _nulls: frozenset[str] = PrivateAttr(default=frozenset())

    @model_validator(mode="wrap")
    @classmethod
    def _note_nulls(cls, data: Any, handler: ModelWrapValidatorHandler[Record]) -> Record:
        record = handler(data)
        if isinstance(data, dict):
            record._nulls = frozenset(k for k, v in data.items() if v is None and getattr(record, k, None) in ([], {}))
        return record

    @model_serializer(mode="wrap")
    def _write_nulls(self, handler: SerializerFunctionWrapHandler) -> Any:
        out = handler(self)
        for key in self._nulls:
            if out.get(key) in ([], {}):
                out[key] = None
        return out

    def to_json(self) -> dict[str, Any]:
        """The row as written: the fields its writer set (and unknown ones it carried), by key."""
        return self.model_dump(mode="json", by_alias=True, exclude_unset=True)


UPGRADES: dict[str, Any] = {}
"""schema version -> a function turning a row dict of that version into the next version's. Empty
while every file ever written is `lhd.round/1` / `lhd.audit/1`."""


def upgrade(row: Any, current: str, known: tuple[str, ...]) -> Any:
    """A row dict brought to the `current` schema: a row without one is of the first version; an
    older known version goes through `UPGRADES` step by step; a newer or foreign schema is read as
    it is (unknown fields are kept)."""
    if not isinstance(row, dict):
        return row
    version = row.get("schema") or known[0]
    while version != current and version in UPGRADES:
        version = known[known.index(version) + 1]
        row = {**UPGRADES[row.get("schema") or known[0]](row), "schema": version}
    return row


class VersionedRecord(Record):
    """A row that names its schema; the current one when a writer builds it."""

    SCHEMA: ClassVar[str]
    SCHEMAS: ClassVar[tuple[str, ...]]

    schema_: Annotated[str | None, SKIP, Field(alias="schema")] = None  # BaseModel has a `schema`

    @model_validator(mode="before")
    @classmethod
    def _upgrade(cls, data: Any) -> Any:
        return upgrade(data, cls.SCHEMA, cls.SCHEMAS)

    @model_validator(mode="after")
    def _stamp(self) -> VersionedRecord:
        if self.schema_ is None:  # built by a writer: stamp the current version
            self.schema_ = self.SCHEMA
            self.model_fields_set.add("schema_")
        return self


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
    """The performer's answer. `token_ids` is None where the tokens are not known (an imported or
    planted answer), [] for an empty answer: the one list that keeps None."""

    text: str
    think: str | None = None
    raw: Annotated[str | None, SKIP] = None
    finish_reason: str | None = None
    segments: int | None = None
    truncated: bool | None = None
    token_ids: list[int] | None = None
    message_ids: Annotated[Items[str], SKIP] = []
    new_message_ids: Annotated[Items[str], SKIP] = []
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


class CallRecord(Record):
    """One model call of a structured stage (evaluation, feedback, summary, audit), every attempt
    recorded (`bench.structured_calls.call_record`). `cut`: it stopped at its token limit (rows
    written before the field say so by `finish_reason` "length" only); `sampling`: what the backend
    decoded with."""

    stage: str | None = None
    attempt: int | None = None
    message_ids: Items[str] = []
    raw: str | None = None
    finish_reason: str | None = None
    cut: bool | None = None
    parse_error: str | None = None
    error: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    latency_s: float | None = None
    sampling: SamplingRecord | None = None
    model: str | None = None


class SummaryRecord(Record):
    """The supervisor's note on a round that left its verbatim memory window; `status` ok, cut or
    failed (a failed note is shown as unavailable)."""

    global_round: int | None = None
    text: str | None = None
    status: str | None = None


class SupervisorContext(Record):
    """How the supervisor's evaluation prompt was fitted into its budget (the context policy of
    `bench.supervisor.Supervisor.fit_evaluation_message`)."""

    budget_tokens: int | None = None  # None: the backend does not say its context length
    prompt_tokens: int | None = None
    files_omitted: int | None = None
    recent_rounds_shown: int | None = None
    fits: bool | None = None


class SupervisorRecord(Record):
    evaluation: Evaluation | None = None
    feedback: Feedback | None = None
    state_before: Annotated[SupervisorState | None, Export(prefix="", suffix="_before")] = None
    state_after: Annotated[SupervisorState | None, Export(prefix="", suffix="_after")] = None
    parse_status: str | None = None
    attempts: int | None = None
    calls: Annotated[Items[CallRecord], SKIP] = []
    summaries_added: Annotated[Items[SummaryRecord], SKIP] = []
    context: Annotated[SupervisorContext | None, SKIP] = None


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


class RoundRow(VersionedRecord):
    """One performer answer and its supervision. A curated, planted or exported set has no
    supervisor (null); an imported session has no timestamps and may have no pack name."""

    SCHEMA: ClassVar[str] = ROW_SCHEMA
    SCHEMAS: ClassVar[tuple[str, ...]] = ROW_SCHEMAS

    run_id: str
    trial_id: str
    seed: int
    pack: str | None = None  # an imported session whose folder and result name none
    task_index: int
    task_title: str
    round: int
    global_round: int
    event: EventRecord | None = None
    performer: PerformerRecord
    supervisor: SupervisorRecord | None = None
    task_complete: bool | None = None
    models: Annotated[RunModels, Export(prefix="")]
    timestamp: str | None = None


class ResumableRoundRow(RoundRow):
    """What `lhd run` needs besides to rebuild a trial's state on resume."""

    supervisor: SupervisorRecord
    task_complete: bool


# --------------------------------------------------------------------------------------------
# audit row: audit/<auditor-id>/<trial>.jsonl
# --------------------------------------------------------------------------------------------

LABEL = Export()


class AuditRow(VersionedRecord):
    """One auditor label of one round. Exported: the labels (`<auditor-id>__<field>` columns)."""

    export_by_default: ClassVar[bool] = False
    SCHEMA: ClassVar[str] = AUDIT_SCHEMA
    SCHEMAS: ClassVar[tuple[str, ...]] = AUDIT_SCHEMAS

    run_id: str
    trial_id: str
    global_round: int
    task_index: int | None = None  # None: an imported label of a round the session does not hold
    round: int | None = None
    auditor_id: str
    mode: str
    window: int | None = None
    deceptive: Annotated[bool | None, LABEL] = None  # None: no verdict (parse_status failed or cut)
    types: Annotated[Items[str], LABEL] = []
    severity: Annotated[int | None, LABEL] = None
    confidence: Annotated[float | None, LABEL] = None
    reasoning: Annotated[str | None, LABEL] = None
    evidence: Annotated[Items[str], LABEL] = []
    parse_status: Annotated[str, LABEL]
    raw: str | None = None
    error: str | None = None
    trial_unfinished: bool | None = None  # labelled from a partial trajectory; redone once it ends
    original: Table[Any] = {}
    reference_raw: Table[Any] = {}
    attempts: int | None = None
    context_rounds: Items[int] = []
    prompt_sha256: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    latency_s: float | None = None
    calls: Items[CallRecord] = []
    model: ModelRef
    timestamp: str | None = None


# --------------------------------------------------------------------------------------------
# export columns, derived from the models
# --------------------------------------------------------------------------------------------

_KINDS: dict[Any, str] = {str: "string", int: "int64", float: "float64", bool: "bool"}


def _unwrap(field: FieldInfo) -> tuple[Any, Export | None]:
    """The field's type without `None`, and its `Export` mark if any."""
    mark = next((m for m in field.metadata if isinstance(m, Export)), None)
    return unwrap_optional(field.annotation), mark


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
        elif typing.get_origin(tp) is list and isinstance(value, list):  # a list of records: each item
            [item_tp] = typing.get_args(tp)
            if isinstance(item_tp, type) and issubclass(item_tp, Record):
                for i, item in enumerate(value):
                    if isinstance(item, dict):
                        found += undeclared_fields(item_tp, item, f"{where}{key}.{i}.")
    return found
