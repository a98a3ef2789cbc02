"""Task packs: the built-in packs, broken packs failing with a precise InputError, and the
authors' reference packs loading unchanged."""
from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from lhd_train.bench.taskpack import (
    BUILTIN_DIR,
    TaskPack,
    list_builtin_packs,
    load_pack,
    pack_sha256,
    pack_text_corpus,
)
from lhd_train.config.vocab import CATEGORIES, LEVELS
from lhd_train.errors import InputError

REF = Path(__file__).resolve().parents[1] / "data" / "reference-packs"  # Apache-2.0, see README there
CODES = {"GC": "GOAL_CONFLICT", "CI": "COMPETITIVE_INTERACTION", "MD": "MORAL_DILEMMA",
         "AD": "AUTHORITY_DIRECTIVE", "IG": "INFORMATION_GAP"}


def ref_dir(name: str) -> Path:
    d = REF / name
    assert (d / "tasks.json").is_file(), f"the authors' packs ship with the tests: {d} is missing"
    return d


# ---------------------------------------------------------------- built-in packs

@pytest.fixture(scope="module", params=["lhd_startup_consulting", "lhd_event_planning"])
def builtin(request: pytest.FixtureRequest) -> TaskPack:
    return load_pack(request.param)


def test_builtin_names() -> None:
    """The authors' packs under their own names, ours prefixed `lhd_` (review N5)."""
    assert list_builtin_packs() == ["activity_planning", "lhd_event_planning", "lhd_startup_consulting",
                                    "startup_consulting"]
    assert load_pack("lhd_startup_consulting").name == "lhd_startup_consulting"


@pytest.mark.parametrize("name", ["startup_consulting", "activity_planning"])
def test_authors_packs_are_built_in_unchanged_with_their_licence(name: str) -> None:
    """Review N5: the paper's packs ship as built-ins, byte for byte the authors' files, with the
    Apache-2.0 licence beside them, and load by their own folder name."""
    folder = BUILTIN_DIR / name
    for f in ("tasks.json", "event_set.json"):
        assert (folder / f).read_bytes() == (ref_dir(name) / f).read_bytes()
    assert "Apache License" in (folder / "LICENSE").read_text(encoding="utf-8")
    assert (folder / "LICENSE").read_bytes() == (REF / "LICENSE").read_bytes()
    pack = load_pack(name)
    assert pack.source_format == "reference" and pack.name == name
    assert pack == load_pack(ref_dir(name)).model_copy(update={"path": folder})


def test_the_default_pack_is_the_papers() -> None:
    from lhd_train.bench.taskpack import DEFAULT_PACK
    from lhd_train.config.run import RunConfig

    assert RunConfig.model_fields["task_pack"].default == DEFAULT_PACK == "startup_consulting"
    assert load_pack(DEFAULT_PACK).source_format == "reference"


def test_pack_hash_names_the_content_not_the_place(tmp_path: Path) -> None:
    pack = load_pack("startup_consulting")
    copy_dir = tmp_path / "startup_consulting"
    copy_dir.mkdir()
    for f in ("tasks.json", "event_set.json"):
        (copy_dir / f).write_bytes((BUILTIN_DIR / "startup_consulting" / f).read_bytes())
    assert pack_sha256(load_pack(copy_dir)) == pack_sha256(pack)
    assert pack_sha256(load_pack("lhd_startup_consulting")) != pack_sha256(pack)
    data = json.loads((copy_dir / "tasks.json").read_text(encoding="utf-8"))
    data["tasks"][0]["title"] += "!"
    (copy_dir / "tasks.json").write_text(json.dumps(data), encoding="utf-8")
    assert pack_sha256(load_pack(copy_dir)) != pack_sha256(pack)


def test_builtin_pack_shape(builtin: TaskPack) -> None:
    assert builtin.source_format == "lhd"
    assert [t.index for t in builtin.tasks] == list(range(1, 15))
    assert [(p.index, p.task_start, p.task_end) for p in builtin.phases] == [(1, 1, 7), (2, 8, 14)]
    assert [builtin.task(t).phase for t in (1, 7, 8, 14)] == [1, 1, 2, 2]
    assert len(builtin.events) == 30
    for phase in (1, 2):
        assert len(builtin.events_of_phase(phase)) == 15
        assert builtin.categories_in_order(phase) == list(CATEGORIES)
        for c in CATEGORIES:
            assert len(builtin.events_of(c, phase)) == 3
    for t in builtin.tasks:
        assert 2 <= len(t.files) <= 4
        assert "Deliverables:" in t.prompt and "cite only the attached files" in t.prompt
        assert ("earlier answers" in t.prompt) == (t.index >= 2)
    total = sum(len(s) for s in pack_text_corpus(builtin))
    assert total < 62_000, total  # the tiny model's context is small


def test_builtin_events_are_well_formed(builtin: TaskPack) -> None:
    for e in builtin.events:
        m = re.match(r"^(GC|CI|MD|AD|IG)(\d)-P(\d): \S", e.name)
        assert m, e.name
        assert CODES[m.group(1)] == e.category and int(m.group(3)) == e.phase
        assert e.id == f"{m.group(1).lower()}{m.group(2)}_p{m.group(3)}"
        assert list(e.variants) == list(LEVELS)
        for text in e.variants.values():
            assert 60 <= len(text) <= 250, text
        assert len(set(e.variants.values())) == 4


def test_builtin_name_and_path_load_the_same(builtin: TaskPack) -> None:
    assert builtin.path is not None
    by_path = load_pack(builtin.path)
    assert by_path == builtin
    assert load_pack(builtin.path / "pack.json") == builtin


def test_corpus_covers_every_text(builtin: TaskPack) -> None:
    corpus = pack_text_corpus(builtin)
    t = builtin.task(5)
    assert t.prompt in corpus and t.files[0].content in corpus
    assert builtin.events[0].variants["CRITICAL"] in corpus


def test_task_lookup_out_of_range(builtin: TaskPack) -> None:
    with pytest.raises(InputError, match="no task 15"):
        builtin.task(15)


# ---------------------------------------------------------------- broken packs

def minimal_pack() -> dict[str, Any]:
    """Two tasks in two phases, one event per category per phase: the smallest valid pack."""
    events = [
        {"id": f"{code.lower()}1_p{p}", "phase": p, "category": cat, "name": f"{code}1-P{p}: test",
         "variants": {lvl: f"{code} {lvl.lower()} pressure in phase {p}." for lvl in LEVELS}}
        for p in (1, 2) for code, cat in CODES.items()
    ]
    return {
        "name": "mini", "domain": "testing", "description": "A pack for tests.",
        "phases": [{"index": 1, "name": "one", "task_start": 1, "task_end": 1},
                   {"index": 2, "name": "two", "task_start": 2, "task_end": 2}],
        "tasks": [
            {"index": 1, "title": "First", "prompt": "Do the first thing.",
             "files": [{"name": "a.csv", "type": "csv", "content": "x,y\n1,2\n"},
                       {"name": "b.json", "type": "json", "content": '{"k": 1}'}]},
            {"index": 2, "title": "Second", "prompt": "Do the second thing.",
             "files": [{"name": "c.txt", "type": "text", "content": "notes"}]},
        ],
        "events": events,
    }


def write_pack(tmp_path: Path, data: dict[str, Any]) -> Path:
    (tmp_path / "pack.json").write_text(json.dumps(data))
    return tmp_path


def test_minimal_pack_loads(tmp_path: Path) -> None:
    pack = load_pack(write_pack(tmp_path, minimal_pack()))
    assert pack.name == "mini" and len(pack.tasks) == 2 and pack.task(2).phase == 2


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(d: dict[str, Any]) -> None:
        *head, last = path.split(".")
        for k in head:
            d = d[int(k)] if k.isdigit() else d[k]
        d[int(last) if last.isdigit() else last] = value
    return edit


def _del(path: str) -> Callable[[dict[str, Any]], None]:
    def edit(d: dict[str, Any]) -> None:
        *head, last = path.split(".")
        for k in head:
            d = d[int(k)] if k.isdigit() else d[k]
        del d[last]
    return edit


BROKEN = {
    "missing level": (_del("events.3.variants.HIGH"), "events[3].variants.HIGH", "is required"),
    "bad file type": (_set("tasks.0.files.1.type", "xml"), "tasks[0].files[1].type",
                      "'xml' is not allowed (allowed: text, csv, json)"),
    "duplicate task index": (_set("tasks.1.index", 1), "tasks[1].index", "duplicate task index 1"),
    "invalid json file": (_set("tasks.0.files.1.content", '{"k": 1,}'), "tasks[0].files[1].content",
                          "not valid JSON"),
    "ragged csv": (_set("tasks.0.files.0.content", "x,y\n1,2,3\n"), "tasks[0].files[0].content",
                   "line 2 has 3 columns, the header has 2"),
    "unknown key": (_set("tasks.0.colour", "red"), "tasks[0].colour", "unknown key (allowed: index, title"),
    "phase gap": (lambda d: (d["tasks"].append({"index": 3, "title": "Third", "prompt": "Go.", "files": []}),
                             _set("phases.1.task_start", 3)(d), _set("phases.1.task_end", 3)(d)),
                  "phases", "tasks [2] belong to no phase"),
    "phase overlap": (_set("phases.1.task_start", 1), "phases[1].task_start", "phase 2 overlaps phase 1 at task 1"),
    "phase past the end": (_set("phases.1.task_end", 3), "phases[1].task_end", "(allowed: 2..2)"),
    "empty variant": (_set("events.0.variants.LOW", "  "), "events[0].variants.LOW", "must not be empty"),
    "missing category": (lambda d: d["events"].pop(9), "events", "phase 2 has no INFORMATION_GAP event"),
    "bad category": (_set("events.0.category", "goal_conflict"), "events[0].category", "GOAL_CONFLICT, "),
    "event in no phase": (_set("events.0.phase", 3), "events[0].phase", "no phase 3 (allowed: 1, 2)"),
    "duplicate file name": (_set("tasks.1.files.0.name", "a.csv"), "tasks[1].files[0].name",
                            "duplicate file name 'a.csv'"),
    "string index": (_set("tasks.0.index", "1"), "tasks[0].index", "must be an integer (got str)"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_pack_names_file_and_field(tmp_path: Path, case: str) -> None:
    edit, field, problem = BROKEN[case]
    data = copy.deepcopy(minimal_pack())
    edit(data)
    with pytest.raises(InputError) as err:
        load_pack(write_pack(tmp_path, data))
    msg = str(err.value)
    assert msg.startswith(str(tmp_path / "pack.json")), msg
    assert f"field '{field}'" in msg and problem in msg, msg


def test_unparsable_pack_json(tmp_path: Path) -> None:
    (tmp_path / "pack.json").write_text('{"name": ')
    with pytest.raises(InputError, match=r"pack\.json: not valid JSON"):
        load_pack(tmp_path)


def test_unknown_name_lists_builtins(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="startup_consulting") as err:
        load_pack("no_such_pack")
    assert "no such task pack" in str(err.value)
    with pytest.raises(InputError, match="is not a task pack"):
        load_pack(tmp_path)


# ---------------------------------------------------------------- reference format

def to_reference(data: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Write our minimal pack in the authors' schema (docs/reference.md, "Task packs")."""
    tasks = {
        "task_set": {"name": data["name"], "total_tasks": len(data["tasks"]), "phases": len(data["phases"]),
                     "phase_description": {f"phase_{p['index']}": {k: p[k] for k in ("name", "task_start", "task_end")}
                                           for p in data["phases"]}},
        "tasks": [{"task_sequence_num": t["index"], "title": t["title"], "base_prompt": t["prompt"],
                   "files": [{"filename": f["name"], "content": f["content"], "file_type": f["type"]}
                             for f in t["files"]]} for t in data["tasks"]],
    }
    phases: dict[str, Any] = {}
    for e in data["events"]:
        phases.setdefault(f"phase_{e['phase']}", {"events": []})["events"].append(
            {"category": e["category"], "name": e["name"].replace("-P", "_PH"),
             "variants": {lvl.lower(): {"content": txt, "pressure_level": lvl} for lvl, txt in e["variants"].items()}})
    return tasks, {"phases": phases}


def write_reference(tmp_path: Path, tasks: dict[str, Any], events: dict[str, Any]) -> Path:
    (tmp_path / "tasks.json").write_text(json.dumps(tasks))
    (tmp_path / "event_set.json").write_text(json.dumps(events))
    return tmp_path


def test_reference_format_legacy_prompt_and_ids(tmp_path: Path) -> None:
    tasks, events = to_reference(minimal_pack())
    tasks["tasks"][0]["base_prompt"] = {"en": "Legacy prompt."}
    pack = load_pack(write_reference(tmp_path, tasks, events))
    assert pack.source_format == "reference" and pack.name == tmp_path.name
    assert pack.task(1).prompt == "Legacy prompt."
    assert pack.events[0].id == "gc1_ph1" and pack.events[0].variants["LOW"].startswith("GC low")


def test_reference_format_missing_variant(tmp_path: Path) -> None:
    tasks, events = to_reference(minimal_pack())
    del events["phases"]["phase_1"]["events"][2]["variants"]["high"]
    with pytest.raises(InputError) as err:
        load_pack(write_reference(tmp_path, tasks, events))
    assert str(err.value).startswith(str(tmp_path / "event_set.json"))
    assert "field 'phases.phase_1.events[2].variants.high': is required" in str(err.value)


def test_reference_format_mismatched_pressure_level(tmp_path: Path) -> None:
    tasks, events = to_reference(minimal_pack())
    events["phases"]["phase_2"]["events"][0]["variants"]["low"]["pressure_level"] = "HIGH"
    with pytest.raises(InputError, match=r"variants\.low\.pressure_level': 'HIGH' does not match its key"):
        load_pack(write_reference(tmp_path, tasks, events))


def test_reference_format_needs_event_set(tmp_path: Path) -> None:
    tasks, _ = to_reference(minimal_pack())
    (tmp_path / "tasks.json").write_text(json.dumps(tasks))
    with pytest.raises(InputError, match=r"event_set\.json: missing"):
        load_pack(tmp_path)


@pytest.mark.parametrize("name,files,per_phase,per_category", [
    ("startup_consulting", 34, 20, 4), ("activity_planning", 36, 15, 3)])
def test_authors_packs_load_unchanged(name: str, files: int, per_phase: int, per_category: int) -> None:
    pack = load_pack(ref_dir(name))
    assert pack.source_format == "reference"
    assert len(pack.tasks) == 14 and sum(len(t.files) for t in pack.tasks) == files
    assert [pack.task(t).phase for t in (1, 7, 8, 14)] == [1, 1, 2, 2]
    for phase in (1, 2):
        assert len(pack.events_of_phase(phase)) == per_phase
        assert pack.categories_in_order(phase) == list(CATEGORIES)
        assert all(len(pack.events_of(c, phase)) == per_category for c in CATEGORIES)
    assert all(list(e.variants) == list(LEVELS) for e in pack.events)
