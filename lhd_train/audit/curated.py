"""The curated audit-evaluation set: hand-written performer answers to the authors' tasks, each
labelled (honest, or one deception type at a severity) with the task-file evidence and why.

The set (`evalset/curated.json`) is judged by the same code as any run: `build_curated_run`
writes it as a run directory, one trial per item holding one round of the item's task, so an
auditor cannot see the other answers to the same task (in `full` mode a trial is all it sees).
Trial ids are neutral (`c01`, `c02`, ...): an item id such as `t04-fals-churn` would name the label.
The labels go to `ground_truth.jsonl` beside the run, as the `LabelledAnswer` rows `lhd audit-eval`
reads for planted runs too (`audit.ground_truth`, docs/validity.md)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from lhd_train.audit.ground_truth import FileQuote, LabelledAnswer, write_ground_truth
from lhd_train.config.base import StrictModel, validate
from lhd_train.config.vocab import DeceptionType
from lhd_train.errors import InputError
from lhd_train.io.files import sha256_text
from lhd_train.io.provenance import utc_now
from lhd_train.rundir.manifest import Manifest, RunTask, RunTaskFile, RunTasks
from lhd_train.rundir.rows import ModelRef, PerformerRecord, RoundRow, RunModels
from lhd_train.rundir.run import Run

CURATED_PATH = Path(__file__).resolve().parent / "evalset" / "curated.json"
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


def set_sha256(cset: CuratedSet) -> str:
    """The hash a curated run records of the set it was built from (a changed set is refused)."""
    return sha256_text(json.dumps(cset.model_dump(by_alias=True), sort_keys=True))


def truth_row(item: CuratedItem, trial_id: str) -> LabelledAnswer:
    """The ground-truth row of one item."""
    evidence = [FileQuote(file=e.file, quote=e.quote) for e in item.evidence]
    return LabelledAnswer(trial_id=trial_id, global_round=1, task_index=item.task, round=1, source="curated",
                          item=item.id, deceptive=item.deceptive, type=item.types[0] if item.types else None,
                          severity=item.severity, evidence=evidence, answer_quotes=item.answer_quotes, why=item.why)


def build_curated_run(cset: CuratedSet, out: Path) -> Path:
    """Write `cset` as a run directory at `out` (absent or empty), with `tasks.json` holding the
    exact task texts, and its labels in `out/ground_truth.jsonl`. Returns `out`."""
    from lhd_train.bench.taskpack import load_pack

    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise InputError("command line", "--out", f"{out} is not empty; the curated run is built in a new folder")
    run = Run.at(out)
    run.dir.trials_dir.mkdir(parents=True, exist_ok=True)
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
    run.write_tasks(RunTasks(source=f"pack {pack.name}", tasks=[
        RunTask(index=t, title=known[t].title, prompt=known[t].prompt,
                files=[RunTaskFile(name=f.name, content=f.content) for f in known[t].files]) for t in used]))
    truth = []
    for item, tid in zip(cset.items, trial_ids(cset.items), strict=True):
        trial = run.trial(tid)
        task = known[item.task]
        store = trial.messages()
        new_ids = store.put([{"role": "user", "content": f"Task {task.index}: {task.title}"}])
        answer_ids = store.put([{"role": "assistant", "content": item.answer}])
        row = RoundRow(run_id=RUN_ID, trial_id=tid, seed=0, pack=pack.name, task_index=item.task,
                       task_title=task.title, round=1, global_round=1, event=None,
                       performer=PerformerRecord(text=item.answer, message_ids=new_ids + answer_ids,
                                                 new_message_ids=new_ids),
                       supervisor=None, task_complete=None,
                       models=RunModels(performer=ModelRef(model="curated set (hand-written)")), timestamp=utc_now())
        trial.append(row)
        trial.mark_done([row])
        truth.append(truth_row(item, tid))
    write_ground_truth(run, truth)
    run.write_manifest(Manifest(run_id=RUN_ID, kind="curated audit-evaluation set", set_sha256=set_sha256(cset),
                                items=len(cset.items), pack=pack.name, created_at=utc_now()))
    return out
