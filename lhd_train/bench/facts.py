"""Numeric facts of a task pack's files: what both the lens probe sets and the judge-free
experiment (`lhd entitle`) ask about.

A fact is one number the files state about one thing: a CSV cell (the row's first cell names the
entity, the header the attribute), a JSON number field (the path names them) or a `Key: value`
text line. A value is kept whole as written, with its currency sign, thousands separators,
decimals, percent sign and scale (`$1.5M`, `2.4 million`, `$9.99`, `$3,600`, `12%`): a value cut
short (`$1` for `$1.5M`) makes the honest answer look wrong. A text line is skipped when its
"value" is not one: a clock time (`Workshop 1 (Sat 10:30)`), one end of a range or a change
(`$3,600-$18,000`, `50 -> 500`), a compound modifier (`2-week pilot`) or `24/7`."""
from __future__ import annotations

import csv
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: scale words a value may carry after its number (`$1.5M`, `2.4 million`, `300k`)
_SCALE = r"(?:thousand|million|billion|bn|mn|[kKmMbB])"
_DIGITS = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+"
_NUM = re.compile(rf"^\s*(?P<pre>[$€£]?)\s*(?P<num>-?(?:{_DIGITS}))(?P<gap>\s*)(?P<post>%|{_SCALE}(?![A-Za-z]))?\s*$")
# a whole value: the number is not cut inside its digits (`(?![\d]|[.,]\d)`), its scale word or
# percent sign comes with it, and no letter or digit is glued to its end
_VALUE = (rf"[$€£]?\s*-?(?:{_DIGITS})(?!\d|[.,]\d)(?:\s*(?:%|{_SCALE}(?![A-Za-z])))?(?![A-Za-z0-9])"
          r"(?!-[A-Za-z])(?!/\d)")  # nor a compound modifier (`2-week`) or `24/7`
_KEY_LINE = re.compile(
    r"^\s*(?:[-*•]\s*)?(?P<key>[A-Za-z][A-Za-z0-9 /()&'_-]{1,60}?)\s*:\s*(?P<val>" + _VALUE + ")"
)
_RANGE_AFTER = re.compile(r"^\s*(?:-|–|—|to\b|->|→)\s*[$€£]?\s*\d")


@dataclass
class Fact:
    """One number a file states: `value_text` as written, and the characters of its line."""

    file: str
    kind: str  # csv | json | text
    entity: str | None
    attribute: str
    value_text: str
    line_start: int | None  # chars of the evidence line in the file content
    line_end: int | None

    def claim(self, attribute: str | None = None, value: str | None = None) -> str:
        """The fact as one sentence that cites its file (the probe sets' claims)."""
        attr = attribute or self.attribute
        val = value or self.value_text
        if self.entity:
            return f"According to {self.file}, the {attr} of {self.entity} is {val}."
        return f"According to {self.file}, the {attr} is {val}."


def lines_with_offsets(text: str) -> list[tuple[int, int, str]]:
    """(start, end, line) of each line, ends without the newline: spans the facts and probes cut at."""
    out, pos = [], 0
    for raw in text.splitlines(keepends=True):
        line = raw.rstrip("\r\n")
        out.append((pos, pos + len(line), line))
        pos += len(raw)
    return out


def _clean_name(s: str) -> str:
    return " ".join(s.replace("_", " ").split()).strip()


@dataclass(frozen=True)
class NumberFormat:
    """A value's number and how it is written: `prefix` (currency), `suffix` (`%` or a scale word)
    with the `gap` before it, `decimals`, and whether thousands are separated by commas."""

    prefix: str
    value: float
    gap: str
    suffix: str
    decimals: int
    thousands_sep: bool

    def write(self, value: float) -> str:
        """`value` written in this format."""
        body = f"{value:,.{self.decimals}f}" if self.thousands_sep else f"{value:.{self.decimals}f}"
        return f"{self.prefix}{body}{self.gap if self.suffix else ''}{self.suffix}"


def parse_number(text: str) -> NumberFormat | None:
    """The number of a value like `$1,200.50`, `40%`, `3.5`, `$1.5M`, `2.4 million`, or None."""
    m = _NUM.match(text)
    if not m:
        return None
    num = m.group("num")
    try:
        val = float(num.replace(",", ""))
    except ValueError:
        return None
    decimals = len(num.split(".", 1)[1]) if "." in num else 0
    return NumberFormat(m.group("pre") or "", val, m.group("gap") or "", m.group("post") or "", decimals, "," in num)


def different_number(text: str, rng: random.Random) -> str:
    """A different number in the same format (currency, separators, decimals, percent sign,
    scale word): `$1.5M` gives e.g. `$2.2M`, never `$2`."""
    parsed = parse_number(text)
    if parsed is None:
        raise ValueError(f"not a number: {text!r}")
    val = parsed.value
    for factor in rng.sample([1.5, 0.6, 2.0, 0.75, 1.3, 0.5, 3.0], 7):
        new = round(val * factor, parsed.decimals) if val != 0 else float(rng.randint(1, 9))
        out = parsed.write(new)
        again = parse_number(out)
        if out != text.strip() and again is not None and again.value != val:
            return out
    return parsed.write(val + 1)


def _csv_facts(name: str, content: str) -> list[Fact]:
    lines = lines_with_offsets(content)
    while lines and (not lines[0][2].strip() or lines[0][2].lstrip().startswith("#")):
        lines = lines[1:]  # comment lines before the header
    rows = [(s, e, next(csv.reader([line]), [])) for s, e, line in lines if line.strip()]
    if len(rows) < 2:
        return []
    header = [_clean_name(h) for h in rows[0][2]]
    facts = []
    for s, e, row in rows[1:]:
        if len(row) != len(header) or not row or parse_number(row[0]) is not None:
            continue
        entity = _clean_name(row[0])
        for col, cell in zip(header[1:], row[1:], strict=False):
            if col and parse_number(cell) is not None:
                facts.append(Fact(name, "csv", entity, col, cell.strip(), s, e))
    return facts


def _json_facts(name: str, content: str) -> list[Fact]:
    try:
        obj = json.loads(content)
    except json.JSONDecodeError:
        return []
    facts: list[Fact] = []

    def walk(node: Any, path: list[str]) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, path + [str(k)])
        elif isinstance(node, list):
            for i, v in enumerate(node):
                label = None
                if isinstance(v, dict):
                    label = next((str(v[k]) for k in ("name", "id", "title", "segment", "region")
                                  if isinstance(v.get(k), str)), None)
                walk(v, path[:-1] + [label] if label and path else path + [label or f"item {i + 1}"])
        elif isinstance(node, (int, float)) and not isinstance(node, bool) and path:
            raw = json.dumps(node)
            span = None
            m = re.search(rf'"{re.escape(path[-1])}"\s*:\s*{re.escape(raw)}(?![\d.])', content)
            if m:
                start = content.rfind("\n", 0, m.start()) + 1
                end = content.find("\n", m.end())
                span = (start, len(content) if end < 0 else end)
            entity = _clean_name(" ".join(path[:-1])) or None
            facts.append(Fact(name, "json", entity, _clean_name(path[-1]), raw, *(span or (None, None))))

    walk(obj, [])
    return facts


def _text_facts(name: str, content: str) -> list[Fact]:
    facts = []
    for s, e, line in lines_with_offsets(content):
        m = _KEY_LINE.match(line)
        if not m or parse_number(m.group("val")) is None:
            continue
        if m.group("key")[-1].isdigit() and line[m.end("key"):m.start("val")] == ":":
            continue  # a clock time (`Sat 10:30`), not a key and its value
        if _RANGE_AFTER.match(line[m.end("val"):]):
            continue  # one end of a range or a change (`$3,600-$18,000`, `50 -> 500`) is not the value
        facts.append(Fact(name, "text", None, _clean_name(m.group("key")).lower(), " ".join(m.group("val").split()),
                          s, e))
    return facts


def extract_facts(name: str, content: str, ftype: str | None = None) -> list[Fact]:
    """The numeric facts of one file (module doc); `ftype` (`csv`, `json`, `text`) else the suffix."""
    kind = (ftype or "").lower()
    suffix = Path(name).suffix.lower()
    if kind == "csv" or suffix == ".csv":
        return _csv_facts(name, content)
    if kind == "json" or suffix == ".json":
        return _json_facts(name, content)
    return _text_facts(name, content)
