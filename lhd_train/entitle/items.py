"""The experiment's items: numeric facts of a task pack's files, each with the values its
conditions need, chosen so that the code can label any answer about it.

Facts come from `lhd_train.bench.facts.extract_facts` (as the probe sets' do). A fact is kept only
when every condition can be built: its line can be deleted without its value remaining elsewhere
(`figures.same_figure`, both ways), its value occurs once on its line, and X' and Y can be drawn.
Each kept fact gets a control question about another task's fact. Every dropped fact is counted by
reason (`BuildReport`). docs/entitle.md, "Items"."""
from __future__ import annotations

import csv
import io
import random
import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from lhd_train.bench.facts import Fact, different_number, extract_facts
from lhd_train.bench.taskpack import Task, TaskPack
from lhd_train.entitle.figures import Figure, find_figures, parse_value, same_figure

SCHEMA = "lhd.entitle-item/1"
_PERCENT_NAME = re.compile(r"(?:\bpct\b|\bpercent|\bpercentage\b|%|\bshare\b)", re.I)
DROP_KIND = "JSON fact (its line cannot be deleted)"
DROP_ELSEWHERE = "value elsewhere in the files"
DROP_TWICE = "value twice on its line"
DROP_VALUES = "no altered or demanded value could be drawn"
DROP_UNPARSED = "value not a figure"


@dataclass(frozen=True)
class ControlFact:
    """Another task's fact, asked about with this item's files."""

    fact_id: str
    task: int
    file: str
    entity: str | None
    attribute: str


@dataclass(frozen=True)
class Item:
    """One fact and the values of its conditions. `value` is X as the file writes it, `altered`
    X' (written into the file in the altered condition), `demanded` Y (what the pressure event
    asks for); `percent` says the values are percentages (a `%` sign, or a pct/percent column)."""

    fact_id: str
    pack: str
    task: int
    task_title: str
    file: str
    kind: str
    entity: str | None
    attribute: str
    value: str
    altered: str
    demanded: str
    percent: bool
    line: tuple[int, int]
    control: ControlFact | None = None
    schema: str = SCHEMA

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Item:
        c = d.get("control")
        return cls(**{**d, "line": tuple(d["line"]), "control": ControlFact(**c) if c else None})

    def as_label_value(self, text: str) -> str:
        """A value as the labeller reads it: a percentage gets its sign."""
        return f"{text}%" if self.percent and not text.rstrip().endswith("%") else text


@dataclass
class BuildReport:
    """What item building saw: candidate facts, kept items, and the dropped ones by reason."""

    candidates: int = 0
    kept: int = 0
    dropped: Counter[str] = field(default_factory=Counter)
    no_control: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"candidates": self.candidates, "kept": self.kept, "dropped": dict(self.dropped),
                "no_control": self.no_control}


def file_figures(task: Task, skip: tuple[str, int, int] | None = None) -> list[Figure]:
    """Every figure of the task's files (years kept; a CSV file cell by cell, since `44,156,121`
    there is three cells, not one number); `skip`: (file, start, end) of a line left out."""
    figs: list[Figure] = []
    for f in task.files:
        text = f.content
        if skip and f.name == skip[0]:
            text = text[:skip[1]] + text[skip[2]:]
        pieces = [cell for row in csv.reader(io.StringIO(text)) for cell in row] if f.type == "csv" else [text]
        for piece in pieces:
            figs += find_figures(piece, keep_years={float(y) for y in re.findall(r"\b(?:19|20)\d\d\b", piece)})
    return figs


def in_figures(value: Figure, figs: list[Figure]) -> bool:
    """Whether any of `figs` is `value` by the labeller's rule, read either way."""
    return any(same_figure(f, value) or same_figure(value, f) for f in figs)


def _percent(fact: Fact) -> bool:
    return fact.value_text.strip().endswith("%") or bool(_PERCENT_NAME.search(fact.attribute))


def _line_end(content: str, end: int) -> int:
    return end + 1 if end < len(content) and content[end] == "\n" else end


def value_positions(line: str, value: str) -> list[int]:
    """Where `value` stands on `line` as a whole number (not inside a longer one)."""
    return [m.start() for m in re.finditer(rf"(?<![\d.]){re.escape(value)}(?![\d])", line)]


def _draw(value: str, rng: random.Random, taken: list[Figure], figs: list[Figure]) -> str | None:
    """A different number in `value`'s format that is none of `taken` and nowhere in `figs`."""
    for _ in range(12):
        new = different_number(value, rng)
        try:
            fig = parse_value(new)
        except ValueError:
            continue
        if not in_figures(fig, taken) and not in_figures(fig, figs):
            return new
    return None


def _candidate(task: Task, fact: Fact, rng: random.Random, report: BuildReport) -> dict[str, Any] | None:
    """The values of one fact's conditions, or None (counted in `report`) when one cannot be built."""
    if fact.kind not in ("csv", "text") or fact.line_start is None or fact.line_end is None:
        report.dropped[DROP_KIND] += 1
        return None
    try:
        x = parse_value(fact.value_text)
    except ValueError:
        report.dropped[DROP_UNPARSED] += 1
        return None
    content = next(f.content for f in task.files if f.name == fact.file)
    if in_figures(x, file_figures(task, (fact.file, fact.line_start, _line_end(content, fact.line_end)))):
        report.dropped[DROP_ELSEWHERE] += 1
        return None
    if len(value_positions(content[fact.line_start:fact.line_end], fact.value_text)) != 1:
        report.dropped[DROP_TWICE] += 1
        return None
    figs = file_figures(task)
    altered = _draw(fact.value_text, rng, [x], figs)
    demanded = _draw(fact.value_text, rng, [x, parse_value(altered)], figs) if altered else None
    if altered is None or demanded is None:
        report.dropped[DROP_VALUES] += 1
        return None
    return {"altered": altered, "demanded": demanded}


def _facts(task: Task) -> list[Fact]:
    facts = [fact for f in task.files for fact in extract_facts(f.name, f.content, f.type)]
    return list({(f.file, f.entity, f.attribute): f for f in facts}.values())  # one per (entity, attribute)


def build_items(pack: TaskPack, n_facts: int, seed: int = 0, per_task: int | None = None) -> tuple[list[Item],
                                                                                                  BuildReport]:
    """Up to `n_facts` items, spread over the pack's tasks in turn (at most `per_task` each), in a
    seeded order; and what was dropped. The same pack, count and seed give the same items."""
    rng = random.Random(seed)
    report = BuildReport()
    pools: dict[int, list[Fact]] = {}
    for task in pack.tasks:
        facts = _facts(task)
        rng.shuffle(facts)
        pools[task.index] = facts
    report.candidates = sum(len(v) for v in pools.values())
    chosen: list[tuple[Task, Fact, dict[str, Any]]] = []
    counts: Counter[int] = Counter()
    tasks = [t for t in pack.tasks if pools[t.index]]
    while len(chosen) < n_facts and any(pools[t.index] for t in tasks):
        for task in tasks:  # one fact per task per pass: items spread over tasks
            if len(chosen) >= n_facts:
                break
            while pools[task.index] and (per_task is None or counts[task.index] < per_task):
                fact = pools[task.index].pop()
                values = _candidate(task, fact, rng, report)
                if values is not None:
                    chosen.append((task, fact, values))
                    counts[task.index] += 1
                    break
            if per_task is not None and counts[task.index] >= per_task:
                pools[task.index] = []
    items = []
    for k, (task, fact, values) in enumerate(chosen):
        control = _control(pack, task, rng)
        report.no_control += control is None
        items.append(Item(fact_id=f"{pack.name}/t{task.index}/f{k}", pack=pack.name, task=task.index,
                          task_title=task.title, file=fact.file, kind=fact.kind, entity=fact.entity,
                          attribute=fact.attribute, value=fact.value_text, percent=_percent(fact),
                          line=(int(fact.line_start or 0), int(fact.line_end or 0)), control=control, **values))
    report.kept = len(items)
    return items, report


def _control(pack: TaskPack, task: Task, rng: random.Random) -> ControlFact | None:
    """A fact of another task whose entity (its attribute, when it has none) and value are nowhere
    in `task`'s files."""
    text = "\n".join(f.content for f in task.files).lower()
    figs = file_figures(task)
    others = [(t, f) for t in pack.tasks if t.index != task.index for f in _facts(t)]
    rng.shuffle(others)
    for t, f in others:
        if (f.entity or f.attribute).lower() in text:
            continue
        try:
            if in_figures(parse_value(f.value_text), figs):
                continue
        except ValueError:
            continue
        return ControlFact(fact_id=f"{pack.name}/t{t.index}/{f.file}/{f.entity}/{f.attribute}", task=t.index,
                           file=f.file, entity=f.entity, attribute=f.attribute)
    return None
