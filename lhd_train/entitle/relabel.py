"""`lhd entitle label IN.jsonl --out OUT.jsonl`: the labeller on answers from any source (an API
model's, a run's, a hand-written set), so a user can label answers without running `lhd entitle`.

A row holds `answer` and `shown` (the files' value; null when the files lack the fact), and may
hold `demanded` (Y; null without pressure), `value` (the true X, for `equals_truth`), `entity`,
`attribute` (their numbers are not claims), `context` (the prompt the model saw: quotations and
copied figures are read against it) and `id`. Every field of a row is written back, with `label`,
`subtype`, `reason` and `asserted` set by `labels.label_answer`. A row that does not validate
stops the command with one line naming the file, the line and the field."""
from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from lhd_train.entitle.figures import parse_value
from lhd_train.entitle.labels import label_answer
from lhd_train.errors import InputError, data_file_error
from lhd_train.io.files import atomic_write_text, json_text, read_jsonl_lines


class AnswerToLabel(BaseModel):
    """One input row (module doc); other fields are kept as they are."""

    model_config = ConfigDict(extra="allow")

    id: str | int | None = None
    answer: str
    shown: str | None
    demanded: str | None = None
    value: str | None = None
    entity: str | None = None
    attribute: str | None = None
    context: str | None = None

    @field_validator("shown", "demanded", "value", mode="before")
    @classmethod
    def _number_as_text(cls, v: Any) -> Any:
        """A JSON number is taken as written (`8.4` -> "8.4")."""
        return str(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v

    @field_validator("shown", "demanded", "value")
    @classmethod
    def _a_figure(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                parse_value(v)
            except ValueError:
                raise ValueError(f"{v!r} holds no figure (a number such as 12%, $1.5M, 2,400 or 0.9)") from None
        return v


def label_row(row: AnswerToLabel) -> dict[str, Any]:
    """`row` with its label, subtype, the rule that decided and the asserted figure."""
    lab = label_answer(row.answer, row.shown, row.demanded, [p for p in (row.entity, row.attribute) if p],
                       row.context, value=row.value)
    out = row.model_dump()
    out.update(label=lab.label, subtype=lab.subtype or lab.label, reason=lab.reason,
               asserted=lab.asserted.text if lab.asserted else None)
    return out


def read_answers(path: Path) -> list[AnswerToLabel]:
    """The rows of `path`, each validated; the first bad one is a one-line error (file, line, field)."""
    if not path.is_file():
        raise InputError(path, None, "no such file (a JSONL file of answers to label)")
    rows = []
    for line, raw in read_jsonl_lines(path, hand_written=True):
        try:
            rows.append(AnswerToLabel.model_validate(raw))
        except ValidationError as err:
            raise data_file_error(err, path, line=line) from None
    if not rows:
        raise InputError(path, None, "holds no answer (one JSON object per line, with 'answer' and 'shown')")
    return rows


def relabel_file(src: Path, out: Path) -> Counter[str]:
    """Label every row of `src` and write them to `out` (module doc); the count of each label."""
    labelled = [label_row(r) for r in read_answers(src)]
    atomic_write_text(out, "".join(json_text(r) + "\n" for r in labelled))
    return Counter(r["label"] for r in labelled)
