"""An entitle experiment is a run directory (`lhd entitle run --out DIR`): each answer is one trial
holding one round (`AnswerRound`: a `RoundRow` whose `entitle` field, `AnswerRecord`, holds the
cell, the fact's values and the code label), so every stage that reads runs reads it as it is.
Trial ids are neutral (`a` + 12 hex digits of the answer id's hash); `append` writes an answer
once, and a request that failed writes nothing (its answers stay missing, counted against the
plan, and a rerun with the same --out asks again). docs/entitle.md, "Files" (every file of DIR)."""
from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from lhd_train.errors import DataFileError, data_file_error
from lhd_train.io.files import atomic_write_text, json_text, read_json_mapping, read_jsonl_lines
from lhd_train.rundir.manifest import Manifest
from lhd_train.rundir.rows import EventRecord, ModelRef, PerformerRecord, Record, RoundRow, RunModels, SamplingRecord
from lhd_train.rundir.run import Run, TrialStore

log = logging.getLogger(__name__)

MANIFEST, ITEMS, SUMMARY = "entitle.json", "items.jsonl", "entitle_summary.json"
READ, STEER = "read", "steer"
RUN_ID = "entitle"
KIND = "entitle experiment"
ERROR = "error"
REPAIR = "a torn or foreign line: restore the file, or choose a new --out"
REDO = ("delete trials/{trial}.* (that answer's files) and rerun `lhd entitle run` with the same --out: it asks for "
        "the missing answer again")
EVENT_NAMES = {"demand": "entitle demand", "mention": "entitle mention"}


class AnswerFields(BaseModel):
    """What a stored answer's record and its flat row share: the cell and fact, the values the
    labeller compared with (`shown`: the files' value, None when they lack it; `demanded`: Y when
    the event states it) and the code label. `sample` 0 is the greedy answer, 1..k the sampled
    ones; token ids are the exact context the lens reads (None from a server backend)."""

    id: str
    fact: str
    files: str
    pressure: str
    sample: int
    file: str
    entity: str | None = None
    attribute: str
    question: str
    value: str
    shown: str | None = None
    demanded: str | None = None
    label: str
    subtype: str | None = None
    label_reason: str | None = None
    asserted: str | None = None
    asserted_span: list[int] | None = None
    figures: list[dict[str, Any]] = []
    abstains: bool = False
    prompt_token_ids: list[int] | None = None


class AnswerRecord(Record, AnswerFields):
    """A round's `entitle` field, strict as every run record. Unknown fields are kept (a steered
    answer's direction and strength)."""


class AnswerRound(RoundRow):
    """A trial row of an entitle experiment: the ordinary round plus its `entitle` record."""

    entitle: AnswerRecord


class AnswerRow(AnswerFields):
    """One answer as the experiment's readers use it (metrics, compare, lens reads, steering): the
    round and its record flattened."""

    model_config = ConfigDict(extra="allow")

    pack: str
    task: int
    seed: int | None
    temperature: float
    max_tokens: int
    answer: str = ""
    finish_reason: str | None = None
    error: str | None = None
    attempts: int = 1
    messages: list[dict[str, str]] = []
    answer_token_ids: list[int] | None = None
    model: str = ""
    adapter: str | None = None
    created_at: str | None = None
    trial_id: str | None = None

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"

    @property
    def condition(self) -> str:
        return f"{self.files}/{self.pressure}"

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


class PackRef(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    sha256: str | None = None


class ModelRecord(BaseModel):
    model_config = ConfigDict(extra="allow", protected_namespaces=())
    spec: dict[str, Any] = {}
    adapter: str | None = None


class EntitleRecord(BaseModel):
    """entitle.json, as the readers use it (every other key is kept: `extra`)."""

    model_config = ConfigDict(extra="allow", protected_namespaces=())
    settings: dict[str, Any] = {}
    pack: PackRef
    model: ModelRecord = ModelRecord()
    run_config: dict[str, Any] | None = None
    prompts: str | None = None

    @property
    def prompts_dir(self) -> str | None:
        return None if self.prompts in (None, "built-in") else self.prompts


def answer_id(fact: str, files: str, pressure: str, sample: int) -> str:
    return f"{fact}/{files}/{pressure}/s{sample}"


def trial_id_of(answer: str) -> str:
    """The neutral trial id of an answer id (module doc)."""
    return "a" + hashlib.sha256(answer.encode("utf-8")).hexdigest()[:12]


def to_round(row: AnswerRow, seed: int, task_title: str, message_ids: list[str], new_ids: list[str],
             event: str | None, top_p: float | None) -> AnswerRound:
    """The round that stores `row` (its messages already in the trial's store)."""
    names = set(AnswerRecord.model_fields)
    record = AnswerRecord.model_validate({k: v for k, v in row.to_json().items() if k in names}
                                         | dict(row.model_extra or {}))
    sampling = SamplingRecord(temperature=row.temperature, top_p=top_p, max_tokens=row.max_tokens, seed=row.seed,
                              n=1)
    tid = trial_id_of(row.id)
    return AnswerRound(
        run_id=RUN_ID, trial_id=tid, seed=seed, pack=row.pack, task_index=row.task, task_title=task_title, round=1,
        global_round=1,
        event=EventRecord(name=EVENT_NAMES[row.pressure], content=event,  # the mention is no pressure category
                          category="AUTHORITY_DIRECTIVE" if row.pressure == "demand" else None,
                          pressure="HIGH" if row.pressure == "demand" else "LOW") if event is not None else None,
        performer=PerformerRecord(text=row.answer, finish_reason=row.finish_reason, truncated=row.truncated,
                                  token_ids=row.answer_token_ids, message_ids=message_ids, new_message_ids=new_ids,
                                  prompt_tokens=len(row.prompt_token_ids) if row.prompt_token_ids else None,
                                  completion_tokens=len(row.answer_token_ids) if row.answer_token_ids else None,
                                  sampling=sampling, attempts=row.attempts),
        supervisor=None, task_complete=None,
        models=RunModels(performer=ModelRef(model=row.model, adapter=row.adapter)), timestamp=row.created_at,
        entitle=record)


def from_round(r: AnswerRound, messages: list[dict[str, str]]) -> AnswerRow:
    """The flat answer of a stored round; `messages`: its context and answer from the store."""
    e = r.entitle
    p = r.performer
    s = p.sampling or SamplingRecord()
    models = r.models.performer or ModelRef()
    context = messages[:-1] if messages and messages[-1]["role"] == "assistant" else messages
    return AnswerRow.model_validate({
        **e.model_dump(mode="json"), **(e.model_extra or {}), "pack": r.pack or "", "task": r.task_index,
        "seed": s.seed, "temperature": s.temperature or 0.0, "max_tokens": s.max_tokens or 0, "answer": p.text,
        "finish_reason": p.finish_reason, "attempts": p.attempts or 1, "messages": context,
        "answer_token_ids": p.token_ids, "model": models.model or "", "adapter": models.adapter,
        "created_at": r.timestamp, "trial_id": r.trial_id})


class EntitleDir:
    """The files of one entitle experiment (module doc)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.run = Run.at(self.path)
        self._titles: dict[tuple[str, int], str] | None = None

    manifest = property(lambda self: self.path / MANIFEST)
    items_path = property(lambda self: self.path / ITEMS)
    summary_path = property(lambda self: self.path / SUMMARY)
    read_dir = property(lambda self: self.path / READ)
    steer_dir = property(lambda self: self.path / STEER)

    def exists(self) -> bool:
        return self.manifest.is_file()

    def read_manifest(self) -> dict[str, Any]:
        return read_json_mapping(self.manifest)

    def record(self) -> EntitleRecord:
        """entitle.json, checked; a `DataFileError` naming the field when it is not one."""
        try:
            return EntitleRecord.model_validate(self.read_manifest())
        except ValidationError as e:
            raise data_file_error(e, self.manifest, root=EntitleRecord) from None

    def write_manifest(self, record: dict[str, Any]) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.manifest, json_text(record, indent=2))

    def write_run_manifest(self, trials: list[str], packs: list[str], created_at: str) -> None:
        """The run's manifest.json: its kind, pack and the planned trials in plan order."""
        self.run.write_manifest(Manifest(run_id=RUN_ID, kind=KIND, pack=",".join(packs), trials=trials,
                                         items=len(self.item_records()), created_at=created_at))

    def item_records(self) -> list[dict[str, Any]]:
        """items.jsonl as written (`items.Item.from_json` makes them items again)."""
        return [raw for _, raw in read_jsonl_lines(self.items_path, REPAIR)]

    def write_items(self, items: list[dict[str, Any]]) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.items_path, "".join(json_text(i) + "\n" for i in items))

    def _rows(self, trial: TrialStore) -> list[AnswerRound]:
        """A trial's round, checked; a damaged one is a `DataFileError` naming the file, the line
        and the field, with the experiment's repair."""
        try:
            return trial.rows(AnswerRound)
        except DataFileError as e:
            raise DataFileError(e.path, e.problem, e.line, e.field, REDO.format(trial=trial.trial_id)) from None

    def answers(self) -> list[AnswerRow]:
        """Every stored answer, flat, in plan order."""
        out = []
        for t in self.run.trials():
            rows = self._rows(t)
            if rows:
                store = t.messages()
                out += [from_round(r, store.get(r.performer.message_ids)) for r in rows]
        return out

    def latest(self) -> dict[str, AnswerRow]:
        """answer id -> its answer (each id is stored once)."""
        return {r.id: r for r in self.answers()}

    def answered(self) -> set[str]:
        """The answer ids written, each trial marked finished (a kill between its row and its
        marker is finished here: the row is whole, or a reader ignores its torn line)."""
        done = set()
        for t in self.run.trials():
            rows = self._rows(t)
            if rows and not t.files.done.exists():
                t.mark_done(rows)
            done |= {r.entitle.id for r in rows}
        return done

    def task_title(self, pack: str, task: int) -> str:
        if self._titles is None:
            self._titles = {(str(i.get("pack")), int(i.get("task", 0))): str(i.get("task_title") or "")
                            for i in self.item_records()}
        return self._titles.get((pack, task), "")

    def append(self, row: AnswerRow, seed: int = 0, top_p: float | None = None) -> bool:
        """Write one answer as its own trial; False (and nothing written) for a failed request's
        row (`label` error: its answers stay missing) or an answer already stored."""
        if row.label == ERROR:
            log.warning("%s: no answer (%s); a rerun with the same --out asks again", row.id, row.error)
            return False
        trial = self.run.trial(trial_id_of(row.id))
        if self._rows(trial):
            log.warning("%s: already stored in trial %s; not written again", row.id, trial.trial_id)
            return False
        self.run.dir.trials_dir.mkdir(parents=True, exist_ok=True)
        store = trial.messages()
        new_ids = store.put(row.messages)
        answer_ids = store.put([{"role": "assistant", "content": row.answer}])
        event = _event_text(row)
        rr = to_round(row, seed, self.task_title(row.pack, row.task), new_ids + answer_ids, new_ids, event, top_p)
        trial.append(rr)
        trial.mark_done([rr])
        return True

    def rewrite(self, rows: list[AnswerRow]) -> None:
        """Replace the label fields of stored answers (a relabelling; the writer holds the lock)."""
        by_id = {r.id: r for r in rows}
        for t in self.run.trials():
            old = self._rows(t)
            new = [r.model_copy(update={"entitle": AnswerRecord.model_validate(
                {**r.entitle.to_json(), **{k: v for k, v in by_id[r.entitle.id].to_json().items()
                                           if k in LABEL_FIELDS}})}) for r in old if r.entitle.id in by_id]
            if new and new != old:
                atomic_write_text(t.files.rows, "".join(json_text(r.to_json()) + "\n" for r in new))

    def write_summary(self, summary: dict[str, Any], path: Path | None = None) -> None:
        atomic_write_text(path or self.summary_path, json_text(summary, indent=2))

    def summary(self) -> dict[str, Any]:
        return read_json_mapping(self.summary_path) if self.summary_path.is_file() else {}


LABEL_FIELDS = ("label", "subtype", "label_reason", "asserted", "asserted_span", "figures", "abstains")


def _event_text(row: AnswerRow) -> str | None:
    """The event block of a demand or mention cell, as the performer's message shows it."""
    if row.pressure not in EVENT_NAMES or not row.messages:
        return None
    content = row.messages[-1]["content"].partition("=== WHAT IS HAPPENING AT WORK RIGHT NOW ===")[2]
    return content.strip().removesuffix("Complete the task now.").strip() or None
