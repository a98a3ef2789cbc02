"""An entitle directory (`lhd entitle run --out DIR`): its files, named once, and the typed rows
they hold (docs/entitle.md, "Files").

    DIR/entitle.json    what made it: settings, model and adapter, backend description, sampling,
                        package versions, the item build report (written before the first answer)
    DIR/items.jsonl     the items (facts and the values of their conditions)
    DIR/answers.jsonl   one row per generated answer (appended, fsynced; a rerun skips what is done)
    DIR/summary.json    the metrics, recomputed from answers.jsonl at the end of every run
    DIR/read/           `lhd entitle read`; DIR/steer/: `lhd entitle steer`

A row that failed (the backend's error after its retries) is written with `error` set and its
label `error`; a rerun generates it again, and the last row of an id counts."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from lhd_train.errors import data_file_error
from lhd_train.io.files import append_jsonl, atomic_write_text, json_text, read_json_mapping, read_jsonl_lines

MANIFEST, ITEMS, ANSWERS, SUMMARY = "entitle.json", "items.jsonl", "answers.jsonl", "summary.json"
READ, STEER = "read", "steer"
ANSWER_SCHEMA = "lhd.entitle-answer/1"
ERROR = "error"
REPAIR = "a torn or foreign line: remove it and rerun `lhd entitle run` with the same --out (it resumes)"


class AnswerRow(BaseModel):
    """One generated answer, labelled (module doc). `sample` 0 is the greedy answer, 1..k the
    sampled ones; `files`/`pressure` name the condition; `shown`/`demanded` are what the labeller
    compared with; token ids are the exact context the lens reads (None from a server backend)."""

    model_config = ConfigDict(extra="allow")

    schema_: str = ANSWER_SCHEMA
    id: str
    fact: str
    pack: str
    task: int
    file: str
    entity: str | None
    attribute: str
    files: str
    pressure: str
    sample: int
    seed: int | None
    temperature: float
    max_tokens: int
    question: str
    value: str
    shown: str | None
    demanded: str | None
    label: str
    label_reason: str | None = None
    asserted: str | None = None
    asserted_span: list[int] | None = None
    figures: list[dict[str, Any]] = []
    abstains: bool = False
    answer: str = ""
    finish_reason: str | None = None
    error: str | None = None
    attempts: int = 1
    messages: list[dict[str, str]] = []
    prompt_token_ids: list[int] | None = None
    answer_token_ids: list[int] | None = None
    model: str = ""
    adapter: str | None = None
    created_at: str | None = None

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"

    @property
    def condition(self) -> str:
        return f"{self.files}/{self.pressure}"

    def to_json(self) -> dict[str, Any]:
        data = self.model_dump(mode="json")
        data["schema"] = data.pop("schema_")
        return data


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


class EntitleDir:
    """The files of one entitle directory (module doc)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    manifest = property(lambda self: self.path / MANIFEST)
    items_path = property(lambda self: self.path / ITEMS)
    answers_path = property(lambda self: self.path / ANSWERS)
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

    def item_records(self) -> list[dict[str, Any]]:
        """items.jsonl as written (`items.Item.from_json` makes them items again)."""
        return [raw for _, raw in read_jsonl_lines(self.items_path, REPAIR)]

    def write_items(self, items: list[dict[str, Any]]) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.items_path, "".join(json_text(i) + "\n" for i in items))

    def answers(self, path: Path | None = None) -> list[AnswerRow]:
        """Every row in file order (a rerun's row of an id comes after the failed one it replaces)."""
        path = path or self.answers_path
        out = []
        for n, raw in read_jsonl_lines(path, REPAIR):
            raw = {("schema_" if k == "schema" else k): v for k, v in raw.items()}
            try:
                out.append(AnswerRow.model_validate(raw))
            except ValidationError as e:
                raise data_file_error(e, path, line=n, repair=REPAIR, root=AnswerRow) from None
        return out

    def latest(self, path: Path | None = None) -> dict[str, AnswerRow]:
        """id -> the row that counts (the last one written for that id)."""
        return {r.id: r for r in self.answers(path)}

    def append(self, row: AnswerRow, path: Path | None = None) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        append_jsonl(path or self.answers_path, row.to_json())

    def rewrite_answers(self, rows: list[AnswerRow]) -> None:
        """Replace answers.jsonl by `rows` at once (a relabelling; the writer holds the lock)."""
        atomic_write_text(self.answers_path, "".join(json_text(r.to_json()) + "\n" for r in rows))

    def write_summary(self, summary: dict[str, Any], path: Path | None = None) -> None:
        atomic_write_text(path or self.summary_path, json_text(summary, indent=2))

    def summary(self) -> dict[str, Any]:
        return read_json_mapping(self.summary_path)
