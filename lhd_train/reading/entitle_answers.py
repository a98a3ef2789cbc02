"""The answers `lhd entitle read` takes and the contrasts it reads them in.

`AnswerToRead` is the typed row the reader needs (`AnswerToRead.of` takes any object with these
attribute names), so where the answers are stored is one function in the command. The primary
contrasts are within a cell, pairs formed within one prompt (science-5 §2.1): `deleted/none`
fabricated vs abstained, `full/none` contradicted vs supported, `full/demand` capitulated vs
supported; fabricated vs supported within a fact stays as evidence detection (its label is a
function of the cell). docs/entitle.md, "Lens reads with ground truth"."""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Any

CONTROL_FILES = "control"  # the control question asks about another task's fact: no contrast reads it


@dataclass(frozen=True)
class AnswerToRead:
    """One labelled answer and the exact context it was generated from (token ids are None when a
    server backend made it: the context is then tokenised again)."""

    id: str
    fact: str
    task: int
    files: str
    pressure: str
    sample: int
    label: str
    messages: list[dict[str, str]]
    answer: str = ""
    question: str = ""
    attribute: str | None = None
    entity: str | None = None
    asserted_span: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    answer_token_ids: list[int] | None = None

    @property
    def cell(self) -> str:
        return f"{self.files}/{self.pressure}"

    @classmethod
    def of(cls, row: Any) -> AnswerToRead:
        """From any row with these attribute names (`lhd_train.entitle.store.AnswerRow` today)."""
        names = [f.name for f in fields(cls)]
        return cls(**{n: getattr(row, n) for n in names if hasattr(row, n)})


@dataclass(frozen=True)
class Contrast:
    """Positive (the unentitled claim) vs negative (the honest answer) answers, paired within a stratum."""

    name: str
    positive: str
    negative: str
    cells: tuple[str, ...] | None  # None: every cell but the control question
    within: str  # "prompt" (fact and cell) or "fact"
    role: str  # "within-cell" (primary) or "evidence detection" (secondary)

    @property
    def cell(self) -> str:
        return "/".join(self.cells) if self.cells and len(self.cells) == 1 else "all cells"

    def takes(self, files: str, cell: str, label: str) -> bool:
        """Whether an answer of `files` in `cell` labelled `label` is one of this contrast's."""
        if files == CONTROL_FILES or label not in (self.positive, self.negative):
            return False
        return self.cells is None or cell in self.cells

    def stratum(self, fact: str, cell: str) -> str:
        """The group a pair must share: the prompt (fact and cell) or the fact."""
        return f"{fact}|{cell}" if self.within == "prompt" else fact

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "cell": self.cell, "positive": self.positive, "negative": self.negative,
                "within": "one prompt (fact and cell)" if self.within == "prompt" else "one fact", "role": self.role}


WITHIN_CELL = (
    Contrast("fabricated_vs_abstained", "fabricated", "abstained", ("deleted/none",), "prompt", "within-cell"),
    Contrast("contradicted_vs_supported", "contradicted", "supported", ("full/none",), "prompt", "within-cell"),
    Contrast("capitulated_vs_supported", "capitulated", "supported", ("full/demand",), "prompt", "within-cell"),
)
EVIDENCE_DETECTION = Contrast("evidence_detection", "fabricated", "supported", None, "fact", "evidence detection")
CONTRASTS = (*WITHIN_CELL, EVIDENCE_DETECTION)
PRIMARY_CELLS = tuple(c.cell for c in WITHIN_CELL)


def contrast_of_cell(cell: str) -> Contrast:
    """The within-cell contrast read in `cell`; a ValueError naming the cells allowed."""
    for c in WITHIN_CELL:
        if c.cell == cell:
            return c
    raise ValueError(f"no within-cell contrast in {cell!r} (allowed: {', '.join(PRIMARY_CELLS)})")


def select_answers(rows: Iterable[AnswerToRead], max_answers: int | None = None,
                   contrasts: Sequence[Contrast] = CONTRASTS) -> list[AnswerToRead]:
    """The answers some contrast takes, in the order given, grouped by prompt (fact and cell) so the answers of
    one prompt are read one after another; at most `max_answers`, whole facts. An id given twice is an error
    (the caller passes the row that counts)."""
    seen: set[str] = set()
    kept = []
    for a in rows:
        if a.id in seen:
            raise ValueError(f"answer {a.id!r} is given twice (pass the row that counts for each id)")
        seen.add(a.id)
        if any(c.takes(a.files, a.cell, a.label) for c in contrasts):
            kept.append(a)
    order = {f: i for i, f in enumerate(dict.fromkeys(a.fact for a in kept))}
    kept.sort(key=lambda a: (order[a.fact], a.cell))  # stable: samples keep their order within a prompt
    if max_answers is None:
        return kept
    out: list[AnswerToRead] = []
    for fact in order:
        group = [a for a in kept if a.fact == fact]
        if len(out) + len(group) > max_answers:
            break
        out += group
    return out
