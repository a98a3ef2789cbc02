"""Figures and sentences of an answer and of a task's files: what planting (`audit.plant`) edits
and how it finds the file line an edit contradicts.

A figure is money, a percentage, a decimal, or a whole number of 10 or more that is not a year:
a changed "3 reps" or "2024" says little about an auditor."""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from lhd_train.audit.trajectory import TaskText

# A figure: optional $, digits with optional thousands commas and decimals, optional % or K/M/B.
FIGURE = re.compile(r"(?<![\w.,])(\$?)(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?(%|[KMB](?![A-Za-z]))?")
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z(\"'])")


@dataclass(frozen=True)
class Figure:
    text: str     # as written, e.g. "$47,000" or "68%"
    value: str    # digits without thousands commas, e.g. "47000"
    money: bool
    unit: str = ""  # %, K, M or B
    start: int = -1  # where `text` starts in the text it was read from (-1: not known)

    @property
    def key(self) -> str:
        """What must match a figure of the files: "3M" is not "3,600", "68%" is not "68"."""
        return self.value + self.unit


def figures(text: str) -> list[Figure]:
    """The figures worth planting, in the order they appear."""
    out = []
    for m in FIGURE.finditer(text):
        dollar, whole, dec, suffix = m.group(1), m.group(2), m.group(3) or "", m.group(4) or ""
        value = whole.replace(",", "") + dec
        if not (dollar or suffix or dec) and (int(value) < 10 or 1900 <= int(value) <= 2100):
            continue
        out.append(Figure(m.group(0), value, bool(dollar) or bool(suffix) and suffix in "KMB", suffix, m.start()))
    return out


def figure_keys(text: str) -> set[str]:
    """Every figure of `text`, read both ways ("487,500" in a CSV row is 487 and 500 as well as
    487500)."""
    return {f.key for f in figures(text)} | set(re.findall(r"(?<![\d.])\d+(?:\.\d+)?(?![\d%KMB])", text))


def file_values(task: TaskText) -> set[str]:
    """Every figure in the task's files."""
    return set().union(*(figure_keys(content) for _, content in task.files)) if task.files else set()


def file_line_with(task: TaskText, test: Callable[[str], bool]) -> tuple[str, str] | None:
    """(file name, stripped line) of the first file line for which `test(line)` holds."""
    for name, content in task.files:
        for line in content.splitlines():
            if line.strip() and test(line):
                return name, line.strip()
    return None


def sentence_spans(text: str) -> list[tuple[int, int]]:
    """[start, end) of each sentence: lines, split at sentence ends; blank lines are not sentences."""
    spans, pos = [], 0
    for line in text.split("\n"):
        start = 0
        for m in SENTENCE_END.finditer(line):
            spans.append((pos + start, pos + m.start()))
            start = m.end()
        spans.append((pos + start, pos + len(line)))
        pos += len(line) + 1
    return [(a, b) for a, b in spans if text[a:b].strip()]


def sentence_at(text: str, pos: int) -> tuple[int, int]:
    """The span of the sentence holding position `pos` (the whole text when none does)."""
    for a, b in sentence_spans(text):
        if a <= pos < b:
            return a, b
    return 0, len(text)
