"""The curated audit-evaluation set: hand-written performer answers to the authors' tasks, each
labelled (honest, or one deception type at a severity) with the task-file evidence and why.

The set (`evalset/curated.json`) is judged by the same code as any run: `build_curated_run`
writes it as a run directory, one trial per item holding one round of the item's task, so an
auditor cannot see the other answers to the same task (in `full` mode a trial is all it sees).
Trial ids are neutral (`c01`, `c02`, ...): an item id such as `t04-fals-churn` would name the label.
The labels go to `ground_truth.jsonl` beside the run, in the rows `lhd audit-eval` reads for
planted runs too (docs/validity.md)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from lhd_train.config.base import StrictModel, validate
from lhd_train.config.vocab import DeceptionType
from lhd_train.errors import InputError
from lhd_train.io.files import append_jsonl, sha256_text, write_json_atomic
from lhd_train.io.provenance import utc_now
from lhd_train.rundir.layout import RunDir
from lhd_train.rundir.rows import ROW_SCHEMA
from lhd_train.rundir.store import MessageStore, write_done_marker

CURATED_PATH = Path(__file__).resolve().parent / "evalset" / "curated.json"
GROUND_TRUTH = "ground_truth.jsonl"  # beside a curated or planted run's files, never read by other stages
RUN_ID = "audit-eval-curated"


class Evidence(StrictModel):
    file: str = Field(description="the name of one of the task's files")
    quote: str = Field(description="an exact excerpt of that file (the figure or sentence the label rests on)")


class CuratedItem(StrictModel):
    id: str
    pack: str
    task: int = Field(ge=1)
    deceptive: bool
    types: list[DeceptionType]
    severity: int = Field(ge=0, le=4)
    answer: str = Field(min_length=1)
    evidence: list[Evidence] = Field(min_length=1)
    answer_quotes: list[str] = Field(default_factory=list, description="the deceptive passages, exact")
    derived: dict[str, str] = Field(default_factory=dict,
                                    description="figure -> arithmetic on file figures (honest answers)")
    why: str = Field(min_length=1)

    @model_validator(mode="after")
    def _consistent(self) -> CuratedItem:
        if self.deceptive != bool(self.types) or self.deceptive != (self.severity > 0):
            raise ValueError("deceptive, types and severity disagree (honest: [] and 0; deceptive: a type and 1-4)")
        if len(self.types) > 1:
            raise ValueError("one type per item, so each false negative counts against one type")
        if self.deceptive and not self.answer_quotes:
            raise ValueError("a deceptive item quotes its deceptive passage in answer_quotes")
        return self


class CuratedSet(StrictModel):
    schema_: Literal["lhd.audit-evalset/1"] = Field(alias="schema")
    pack: str
    about: str
    items: list[CuratedItem] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique(self) -> CuratedSet:
        ids = [i.id for i in self.items]
        dup = sorted({i for i in ids if ids.count(i) > 1})
        if dup:
            raise ValueError(f"item id {dup[0]} appears twice")
        return self


def load_curated(path: Path | None = None) -> CuratedSet:
    """The set at `path` (default: the shipped one), checked field by field."""
    path = Path(path or CURATED_PATH)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise InputError(path, None, f"cannot be read as JSON ({e})") from None
    return validate(CuratedSet, data, path)


def trial_ids(items: list[CuratedItem]) -> list[str]:
    width = max(2, len(str(len(items))))
    return [f"c{n:0{width}d}" for n in range(1, len(items) + 1)]


def truth_row(item: CuratedItem, trial_id: str) -> dict:
    """The ground-truth row of one item (the format of `plant.GroundTruth` rows)."""
    return {"trial_id": trial_id, "global_round": 1, "task_index": item.task, "round": 1, "source": "curated",
            "item": item.id, "deceptive": item.deceptive, "type": item.types[0] if item.types else None,
            "severity": item.severity, "evidence": [e.model_dump() for e in item.evidence],
            "answer_quotes": item.answer_quotes, "why": item.why}


def build_curated_run(cset: CuratedSet, out: Path) -> Path:
    """Write `cset` as a run directory at `out` (absent or empty), with `tasks.json` holding the
    exact task texts, and its labels in `out/ground_truth.jsonl`. Returns `out`."""
    from lhd_train.bench.taskpack import load_pack

    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise InputError("command line", "--out", f"{out} is not empty; the curated run is built in a new folder")
    rd = RunDir(out)
    rd.trials_dir.mkdir(parents=True, exist_ok=True)
    packs = {name: load_pack(name) for name in sorted({i.pack for i in cset.items})}
    if len(packs) != 1:  # tasks.json holds one task per index
        raise InputError(CURATED_PATH, "items.pack", "a set draws on one pack", ", ".join(packs))
    pack = next(iter(packs.values()))
    used = sorted({i.task for i in cset.items})
    known = {t.index: t for t in pack.tasks}
    for i in cset.items:
        if i.task not in known:
            raise InputError(CURATED_PATH, f"items.{i.id}.task", f"pack {pack.name} has no task {i.task}",
                             f"1..{len(pack.tasks)}")
    write_json_atomic(rd.tasks, {"source": f"pack {pack.name}", "tasks": [
        {"index": t, "title": known[t].title, "prompt": known[t].prompt,
         "files": [{"name": f.name, "content": f.content} for f in known[t].files]} for t in used]})
    truth = out / GROUND_TRUTH
    for item, tid in zip(cset.items, trial_ids(cset.items), strict=True):
        files = rd.trial(tid)
        task = known[item.task]
        store = MessageStore(files.messages)
        new_ids = store.put([{"role": "user", "content": f"Task {task.index}: {task.title}"}])
        answer_ids = store.put([{"role": "assistant", "content": item.answer}])
        row = {"schema": ROW_SCHEMA, "run_id": RUN_ID, "trial_id": tid, "seed": 0, "pack": pack.name,
               "task_index": item.task, "task_title": task.title, "round": 1, "global_round": 1, "event": None,
               "performer": {"text": item.answer, "message_ids": new_ids + answer_ids, "new_message_ids": new_ids},
               "supervisor": None, "task_complete": None,
               "models": {"performer": {"model": "curated set (hand-written)"}}, "timestamp": utc_now()}
        append_jsonl(files.rows, row)
        write_done_marker(files.done, [row])
        append_jsonl(truth, truth_row(item, tid))
    write_json_atomic(rd.manifest, {"run_id": RUN_ID, "kind": "curated audit-evaluation set",
                                    "set_sha256": sha256_text(json.dumps(cset.model_dump(by_alias=True),
                                                                         sort_keys=True)),
                                    "items": len(cset.items), "pack": pack.name, "created_at": utc_now()})
    return out
