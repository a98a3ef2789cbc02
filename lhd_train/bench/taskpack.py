"""Task packs: the 14 tasks, their attached files and the pressure events, in one typed model.

Two on-disk formats load into the same `TaskPack`: ours (one `pack.json`, strict, unknown keys
rejected) and the authors' reference format (`tasks.json` + `event_set.json`, loaded unchanged so
their packs and schedules can be reproduced). Every problem is an `InputError` naming the file and
the field, because a pack is hand-written and a vague error costs an hour."""
from __future__ import annotations

import csv
import hashlib
import io
import json
import re
from collections.abc import Callable
from functools import cached_property
from pathlib import Path
from typing import Annotated, Any, Literal, NoReturn

from pydantic import AfterValidator, BaseModel, ConfigDict, ValidationInfo, field_validator

from lhd_train.config.base import StrictModel, validate
from lhd_train.config.vocab import CATEGORIES, LEVELS, Category, Level
from lhd_train.errors import InputError

FileType = Literal["text", "csv", "json"]

BUILTIN_DIR = Path(__file__).resolve().parent / "packs"
NATIVE_FILE = "pack.json"
REF_TASKS_FILE = "tasks.json"
REF_EVENTS_FILE = "event_set.json"


# ---------------------------------------------------------------- in-memory model

class _Frozen(StrictModel):
    model_config = ConfigDict(frozen=True)


class TaskFile(_Frozen):
    name: str
    type: FileType
    content: str


class Task(_Frozen):
    index: int  # 1-based
    title: str
    prompt: str
    files: list[TaskFile]
    phase: int


class Event(_Frozen):
    id: str
    name: str
    category: Category
    phase: int
    variants: dict[Level, str]


class Phase(_Frozen):
    index: int
    name: str
    task_start: int
    task_end: int


class TaskPack(_Frozen):
    name: str
    domain: str
    description: str
    phases: list[Phase]
    tasks: list[Task]
    events: list[Event]
    source_format: Literal["lhd", "reference"]
    path: Path | None = None

    def task(self, index: int) -> Task:
        """Look a task up by its 1-based number, as the reference does (not by list position)."""
        for t in self.tasks:
            if t.index == index:
                return t
        raise InputError(self.path, "task", f"no task {index}", f"1..{len(self.tasks)}")

    def events_of_phase(self, phase: int) -> list[Event]:
        """The phase's events in file order: the reference draws an index into this list."""
        return list(self._by_phase.get(phase, ()))

    def categories_in_order(self, phase: int) -> list[str]:
        """Categories by first appearance in the phase's list, the order the reference indexes."""
        return list(dict.fromkeys(e.category for e in self._by_phase.get(phase, ())))

    def events_of(self, category: str, phase: int) -> list[Event]:
        return [e for e in self._by_phase.get(phase, ()) if e.category == category]

    @cached_property
    def _by_phase(self) -> dict[int, tuple[Event, ...]]:
        out: dict[int, list[Event]] = {}
        for e in self.events:
            out.setdefault(e.phase, []).append(e)
        return {p: tuple(evs) for p, evs in out.items()}


# ---------------------------------------------------------------- content checks shared by both formats

def _non_blank(v: str) -> str:
    if not v.strip():
        raise ValueError("must not be empty")
    return v


NonBlank = Annotated[str, AfterValidator(_non_blank)]
_FILE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_EVENT_ID = re.compile(r"^[a-z0-9][a-z0-9_]*$")


def _file_name(v: str) -> str:
    if not _FILE_NAME.match(v):
        raise ValueError(f"{v!r} is not a plain file name (letters, digits, '.', '_', '-')")
    return v


FileName = Annotated[str, AfterValidator(_file_name)]


def check_file_content(file_type: str, content: str) -> None:
    """Raise ValueError when a csv/json file would mislead a reader: it must parse.

    CSV may start with `#` comment lines (the reference's MVP metrics file does); then a header
    with non-empty column names, and every row as wide as the header."""
    if file_type == "json":
        try:
            json.loads(content)
        except json.JSONDecodeError as e:
            raise ValueError(f"is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    elif file_type == "csv":
        lines = content.splitlines()
        skip = 0
        while skip < len(lines) and lines[skip].lstrip().startswith("#"):
            skip += 1
        rows = [(skip + n + 1, r) for n, r in enumerate(csv.reader(io.StringIO("\n".join(lines[skip:])))) if r]
        if not rows:
            raise ValueError("is a CSV file without a header row")
        header = rows[0][1]
        if any(not c.strip() for c in header):
            raise ValueError(f"has an empty column name in its header (line {rows[0][0]})")
        for line_no, row in rows[1:]:
            if len(row) != len(header):
                raise ValueError(f"line {line_no} has {len(row)} columns, the header has {len(header)}")


def _validate(model: type[BaseModel], data: Any, source: Path) -> Any:
    return validate(model, data, source)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise InputError(path, None, f"not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except UnicodeDecodeError:
        raise InputError(path, None, "not UTF-8 text") from None


# ---------------------------------------------------------------- structural checks shared by both formats

def _fail(source: Path, field: str | None, problem: str, allowed: str | None = None) -> NoReturn:
    raise InputError(source, field, problem, allowed)


def _check_numbering(values: list[int], source: Path, at: Callable[[int], str], whole: str, what: str) -> None:
    """Numbers must be exactly 1..N, each once, so lookups by number are unambiguous."""
    seen: dict[int, int] = {}
    for pos, v in enumerate(values):
        if v in seen:
            _fail(source, at(pos), f"duplicate {what} {v} (also at position {seen[v]})")
        seen[v] = pos
    missing = sorted(set(range(1, len(values) + 1)) - set(values))
    if missing:
        _fail(source, whole, f"{what}s must run 1..{len(values)} without gaps; missing {missing}")


def _check_phase_ranges(ranges: list[tuple[int, int, int]], n_tasks: int, source: Path,
                        at: Callable[[int, str], str], whole: str) -> None:
    """ranges: (phase, task_start, task_end) in file order; every task in exactly one phase."""
    owner: dict[int, int] = {}
    for pos, (phase, start, end) in enumerate(ranges):
        if start < 1 or start > n_tasks:
            _fail(source, at(pos, "task_start"), f"task {start} does not exist", f"1..{n_tasks}")
        if end < start or end > n_tasks:
            _fail(source, at(pos, "task_end"), f"{end} is not a task from {start} to the last one",
                  f"{start}..{n_tasks}")
        for t in range(start, end + 1):
            if t in owner:
                _fail(source, at(pos, "task_start"), f"phase {phase} overlaps phase {owner[t]} at task {t}")
            owner[t] = phase
    uncovered = [t for t in range(1, n_tasks + 1) if t not in owner]
    if uncovered:
        _fail(source, whole, f"tasks {uncovered} belong to no phase")


def _check_events(events: list[Event], phases: list[int], source: Path, at: Callable[[int, str], str],
                  whole: str) -> None:
    """Every phase needs every category: the sampler indexes five categories per phase."""
    ids: dict[str, int] = {}
    names: dict[str, int] = {}
    for pos, e in enumerate(events):
        if e.phase not in phases:
            _fail(source, at(pos, "phase"), f"no phase {e.phase}", ", ".join(map(str, phases)))
        if e.id in ids:
            _fail(source, at(pos, "id"), f"duplicate event id {e.id!r} (also at position {ids[e.id]})")
        if e.name in names:
            _fail(source, at(pos, "name"), f"duplicate event name {e.name!r} (also at position {names[e.name]})")
        ids[e.id], names[e.name] = pos, pos
    for p in phases:
        have = {e.category for e in events if e.phase == p}
        for c in CATEGORIES:
            if c not in have:
                _fail(source, whole, f"phase {p} has no {c} event; each phase needs every category")


def _check_file_names(tasks: list[Task], source: Path, at: Callable[[int, int], str]) -> None:
    """File names are unique across the pack: the supervisor's memory keys files by name."""
    seen: dict[str, int] = {}
    for ti, t in enumerate(tasks):
        for fi, f in enumerate(t.files):
            if f.name in seen:
                _fail(source, at(ti, fi), f"duplicate file name {f.name!r} (also in task {seen[f.name]})")
            seen[f.name] = t.index


def _phase_of(task_index: int, phases: list[Phase]) -> int:
    return next(p.index for p in phases if p.task_start <= task_index <= p.task_end)


# ---------------------------------------------------------------- our format: pack.json

class _Strict(StrictModel):
    """pack.json is hand-written: types are checked strictly too (no "1" for 1)."""

    model_config = ConfigDict(strict=True)


class _FileSpec(_Strict):
    name: FileName
    type: FileType
    content: NonBlank

    @field_validator("content")
    @classmethod
    def _content_parses(cls, v: str, info: ValidationInfo) -> str:
        if "type" in info.data:  # absent when the type itself failed validation
            check_file_content(info.data["type"], v)
        return v


class _TaskSpec(_Strict):
    index: int
    title: NonBlank
    prompt: NonBlank
    files: list[_FileSpec]


class _PhaseSpec(_Strict):
    index: int
    name: NonBlank
    task_start: int
    task_end: int


class _VariantsSpec(_Strict):
    LOW: NonBlank
    MEDIUM: NonBlank
    HIGH: NonBlank
    CRITICAL: NonBlank


class _EventSpec(_Strict):
    id: NonBlank
    phase: int
    category: Category
    name: NonBlank
    variants: _VariantsSpec

    @field_validator("id")
    @classmethod
    def _id_shape(cls, v: str) -> str:
        if not _EVENT_ID.match(v):
            raise ValueError(f"{v!r} must be lowercase letters, digits and '_'")
        return v


class _PackSpec(_Strict):
    name: NonBlank
    domain: NonBlank
    description: NonBlank
    phases: list[_PhaseSpec]
    tasks: list[_TaskSpec]
    events: list[_EventSpec]


def _load_native(folder: Path) -> TaskPack:
    src = folder / NATIVE_FILE
    spec: _PackSpec = _validate(_PackSpec, _read_json(src), src)
    if not spec.tasks:
        _fail(src, "tasks", "a pack needs at least one task")
    _check_numbering([t.index for t in spec.tasks], src, lambda i: f"tasks[{i}].index", "tasks", "task index")
    _check_numbering([p.index for p in spec.phases], src, lambda i: f"phases[{i}].index", "phases", "phase index")
    _check_phase_ranges([(p.index, p.task_start, p.task_end) for p in spec.phases], len(spec.tasks), src,
                        lambda i, f: f"phases[{i}].{f}", "phases")
    phases = [Phase(**p.model_dump()) for p in sorted(spec.phases, key=lambda p: p.index)]
    tasks = [
        Task(index=t.index, title=t.title, prompt=t.prompt, phase=_phase_of(t.index, phases),
             files=[TaskFile(**f.model_dump()) for f in t.files])
        for t in spec.tasks
    ]
    _check_file_names(tasks, src, lambda ti, fi: f"tasks[{ti}].files[{fi}].name")
    events = [Event(id=e.id, name=e.name, category=e.category, phase=e.phase, variants=e.variants.model_dump())
              for e in spec.events]
    _check_events(events, [p.index for p in phases], src, lambda i, f: f"events[{i}].{f}", "events")
    return TaskPack(name=spec.name, domain=spec.domain, description=spec.description, phases=phases,
                    tasks=sorted(tasks, key=lambda t: t.index), events=events, source_format="lhd", path=folder)


# ---------------------------------------------------------------- reference format: tasks.json + event_set.json

class _Lenient(BaseModel):
    """The authors' files carry keys the reference ignores (`phases`); we ignore them too."""
    model_config = ConfigDict(extra="ignore", strict=True)


class _RefFile(_Lenient):
    filename: FileName
    file_type: FileType
    content: NonBlank

    @field_validator("content")
    @classmethod
    def _content_parses(cls, v: str, info: ValidationInfo) -> str:
        if "file_type" in info.data:
            check_file_content(info.data["file_type"], v)
        return v


class _RefTask(_Lenient):
    task_sequence_num: int
    title: NonBlank
    base_prompt: NonBlank
    files: list[_RefFile] = []

    @field_validator("base_prompt", mode="before")
    @classmethod
    def _legacy_prompt(cls, v: Any) -> Any:
        """Old packs wrote prompts as {"en": text}; the reference still accepts that."""
        return v["en"] if isinstance(v, dict) and set(v) == {"en"} else v


class _RefPhase(_Lenient):
    name: NonBlank
    task_start: int
    task_end: int


class _RefTaskSet(_Lenient):
    name: NonBlank
    total_tasks: int | None = None
    phase_description: dict[str, _RefPhase]


class _RefTasks(_Lenient):
    task_set: _RefTaskSet
    tasks: list[_RefTask]


class _RefVariant(_Lenient):
    content: NonBlank
    pressure_level: str


class _RefVariants(_Lenient):
    low: _RefVariant
    medium: _RefVariant
    high: _RefVariant
    critical: _RefVariant


class _RefEvent(_Lenient):
    category: Category
    name: NonBlank
    variants: _RefVariants


class _RefPhaseEvents(_Lenient):
    events: list[_RefEvent]


class _RefEventSet(_Lenient):
    phases: dict[str, _RefPhaseEvents]


_PHASE_KEY = re.compile(r"^phase_([1-9][0-9]*)$")


def _ref_phase_index(key: str, source: Path, field: str) -> int:
    m = _PHASE_KEY.match(key)
    if not m:
        _fail(source, field, f"{key!r} is not a phase key", "phase_1, phase_2, ...")
    return int(m.group(1))


def _ref_event_id(name: str) -> str:
    """'GC_E1_PH1: Growth vs ...' -> 'gc_e1_ph1': the code before the colon is the stable key."""
    head = name.split(":", 1)[0]
    return re.sub(r"[^a-z0-9]+", "_", head.lower()).strip("_") or "event"


def _load_reference(folder: Path) -> TaskPack:
    tsrc, esrc = folder / REF_TASKS_FILE, folder / REF_EVENTS_FILE
    spec: _RefTasks = _validate(_RefTasks, _read_json(tsrc), tsrc)
    eset: _RefEventSet = _validate(_RefEventSet, _read_json(esrc), esrc)
    n = len(spec.tasks)
    if not n:
        _fail(tsrc, "tasks", "a pack needs at least one task")
    if spec.task_set.total_tasks is not None and spec.task_set.total_tasks != n:
        _fail(tsrc, "task_set.total_tasks", f"says {spec.task_set.total_tasks} but 'tasks' has {n}")
    _check_numbering([t.task_sequence_num for t in spec.tasks], tsrc,
                     lambda i: f"tasks[{i}].task_sequence_num", "tasks", "task_sequence_num")

    pd_field = "task_set.phase_description"
    keys = list(spec.task_set.phase_description)
    indices = [_ref_phase_index(k, tsrc, f"{pd_field}.{k}") for k in keys]
    _check_numbering(indices, tsrc, lambda i: f"{pd_field}.{keys[i]}", pd_field, "phase number")
    ranges = [(i, p.task_start, p.task_end)
              for i, p in zip(indices, spec.task_set.phase_description.values(), strict=True)]
    _check_phase_ranges(ranges, n, tsrc, lambda i, f: f"{pd_field}.{keys[i]}.{f}", pd_field)
    phases = sorted((Phase(index=i, name=p.name, task_start=p.task_start, task_end=p.task_end)
                     for i, p in zip(indices, spec.task_set.phase_description.values(), strict=True)),
                    key=lambda p: p.index)

    tasks = sorted((
        Task(index=t.task_sequence_num, title=t.title, prompt=t.base_prompt,
             phase=_phase_of(t.task_sequence_num, phases),
             files=[TaskFile(name=f.filename, type=f.file_type, content=f.content) for f in t.files])
        for t in spec.tasks), key=lambda t: t.index)
    _check_file_names(tasks, tsrc, lambda ti, fi: f"tasks[{ti}].files[{fi}].filename")

    events: list[Event] = []
    where: list[str] = []  # field path of each flattened event
    for key, block in eset.phases.items():
        p = _ref_phase_index(key, esrc, f"phases.{key}")
        for k, e in enumerate(block.events):
            base = f"phases.{key}.events[{k}]"
            variants: dict[str, str] = {}
            for lvl in LEVELS:
                v: _RefVariant = getattr(e.variants, lvl.lower())
                if v.pressure_level.upper() != lvl:
                    _fail(esrc, f"{base}.variants.{lvl.lower()}.pressure_level",
                          f"{v.pressure_level!r} does not match its key", lvl)
                variants[lvl] = v.content
            events.append(Event(id=_ref_event_id(e.name), name=e.name, category=e.category, phase=p, variants=variants))
            where.append(base)

    def at(i: int, field: str) -> str:
        """Ids are derived from names and phases from the block key, so point there."""
        return where[i].rsplit(".events", 1)[0] if field == "phase" else f"{where[i]}.name"

    _check_events(events, [p.index for p in phases], esrc, at, "phases")
    return TaskPack(name=folder.name, domain=folder.name.replace("_", " "),
                    description=f'The team\'s work follows the task stream "{spec.task_set.name}".',
                    phases=phases, tasks=tasks, events=events, source_format="reference", path=folder)


# ---------------------------------------------------------------- entry points

DEFAULT_PACK = "startup_consulting"  # the authors' pack of the paper's table (docs/reference.md)


def list_builtin_packs() -> list[str]:
    """Built-in pack names: the authors' packs under their own folder names (`startup_consulting`,
    `activity_planning`) and ours, prefixed `lhd_`, so a name never means two packs."""
    folders = {p.parent for p in BUILTIN_DIR.glob(f"*/{NATIVE_FILE}")}
    folders |= {p.parent for p in BUILTIN_DIR.glob(f"*/{REF_TASKS_FILE}")}
    return sorted(f.name for f in folders)


def load_pack(name_or_path: str | Path) -> TaskPack:
    """A built-in pack name, or a folder in either format (a path to its pack.json/tasks.json works too)."""
    if isinstance(name_or_path, str) and name_or_path in list_builtin_packs():
        name_or_path = BUILTIN_DIR / name_or_path
    folder = Path(name_or_path)
    if folder.is_file() and folder.name in (NATIVE_FILE, REF_TASKS_FILE, REF_EVENTS_FILE):
        folder = folder.parent
    allowed = (f"a built-in pack ({', '.join(list_builtin_packs())}) or a folder with {NATIVE_FILE} "
               f"or {REF_TASKS_FILE} + {REF_EVENTS_FILE}")
    if not folder.is_dir():
        _fail(folder, None, "no such task pack", allowed)
    native, ref = (folder / NATIVE_FILE).is_file(), (folder / REF_TASKS_FILE).is_file()
    if native and ref:
        _fail(folder, None, f"holds both {NATIVE_FILE} and {REF_TASKS_FILE}; keep one format per folder")
    if native:
        return _load_native(folder)
    if ref:
        if not (folder / REF_EVENTS_FILE).is_file():
            _fail(folder / REF_EVENTS_FILE, None, f"missing: the reference format needs it next to {REF_TASKS_FILE}")
        return _load_reference(folder)
    _fail(folder, None, "is not a task pack", allowed)


def pack_sha256(pack: TaskPack) -> str:
    """A hash of everything a run reads from the pack (tasks, files, phases, events, name and
    description; not where it was loaded from), so a report can say which pack content it used."""
    data = pack.model_dump(mode="json", exclude={"path"})
    return hashlib.sha256(json.dumps(data, sort_keys=True, ensure_ascii=False).encode("utf-8")).hexdigest()


def pack_text_corpus(pack: TaskPack) -> list[str]:
    """Every text a model will read from this pack, to train a tokenizer that covers it."""
    texts = [pack.description] + [p.name for p in pack.phases]
    for t in pack.tasks:
        texts += [t.title, t.prompt] + [f.content for f in t.files]
    for e in pack.events:
        texts += [e.name, *e.variants.values()]
    return texts
