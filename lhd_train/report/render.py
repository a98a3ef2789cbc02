"""The Jinja2 environment shared by the report and the viewer, number formatting, and the table
model both render (`Table`: HTML through the `table` macro, Markdown for summary.md).

Autoescape is on for every template; the only strings marked safe are our own static CSS and
JS files (never model text). Pages carry a Content-Security-Policy that allows exactly our one
inline script (by its hash) and data: images, so even a missed escape could not run a script or
reach the network."""
from __future__ import annotations

import base64
import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import cache, lru_cache
from pathlib import Path
from typing import Any

from jinja2 import Environment, FileSystemLoader, StrictUndefined
from markupsafe import Markup

TEMPLATES = Path(__file__).resolve().parent / "templates"


@lru_cache(maxsize=1)
def env() -> Environment:
    return Environment(loader=FileSystemLoader(str(TEMPLATES)), autoescape=True, undefined=StrictUndefined,
                       trim_blocks=False, lstrip_blocks=False)


@cache
def asset(name: str) -> str:
    return (TEMPLATES / name).read_text(encoding="utf-8")


def script_hash(source: str) -> str:
    """The CSP source expression that allows exactly this inline script."""
    return "'sha256-" + base64.b64encode(hashlib.sha256(source.encode("utf-8")).digest()).decode() + "'"


def render_page(template: str, script: str | None = None, **ctx: Any) -> str:
    js = asset(script) if script else ""
    return env().get_template(template).render(
        css=Markup(asset("style.css")), script=Markup(js) if js else "",
        script_hash=script_hash(js) if js else "", generated=now(), **ctx)


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")


def isnan(x: Any) -> bool:
    try:
        return x is None or math.isnan(float(x))
    except (TypeError, ValueError):
        return False


def fmt(x: Any, digits: int = 3) -> str:
    """A number for a table cell; NaN/None as an en dash."""
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isnan(x):
        return "–"
    if isinstance(x, int) or (isinstance(x, float) and float(x).is_integer() and digits == 0):
        return str(int(x))
    try:
        return f"{float(x):.{digits}f}"
    except (TypeError, ValueError):
        return str(x)


def pm(mean: Any, se: Any, digits: int = 3) -> str:
    """`mean ± se` as the paper's table prints it."""
    if isnan(mean):
        return "–"
    return fmt(mean, digits) + ("" if isnan(se) else f" ± {fmt(se, digits)}")


def ci(lo: Any, hi: Any, digits: int = 3) -> str:
    if isnan(lo) or isnan(hi):
        return "–"
    return f"[{fmt(lo, digits)}, {fmt(hi, digits)}]"


def signed(x: Any, digits: int = 2) -> str:
    return "–" if isnan(x) else f"{float(x):+.{digits}f}"


def trials_cell(summary: dict) -> str:
    """The trials a run's rates are over, and beside them the trials with no valid label at all
    (no rate), so a 2-trial run never reads as a 1-trial one."""
    n, none = int(summary.get("n_trials", 0) or 0), int(summary.get("n_trials_no_label", 0) or 0)
    return f"{n} (+{none} with no label)" if none else str(n)


@dataclass(frozen=True)
class Link:
    text: str
    href: str


@dataclass(frozen=True)
class Table:
    """A report table: column titles, rows of cells (text, or a `Link`), which columns are numeric
    (right-aligned in HTML). report.html (the `table` macro) and summary.md (`markdown`) render the
    same model, so the two cannot drift apart."""

    columns: Sequence[str]
    rows: Sequence[Sequence[str | Link]]
    numeric: Sequence[bool]

    @classmethod
    def numeric_after(cls, columns: Sequence[str], rows: Sequence[Sequence[str | Link]], n_text: int) -> Table:
        """A table whose first `n_text` columns are text and the others numbers."""
        return cls(columns, rows, [i >= n_text for i in range(len(columns))])

    def markdown(self) -> list[str]:
        def cell(c: str | Link) -> str:
            return (c.text if isinstance(c, Link) else c).replace("|", "\\|").replace("\n", " ")

        return ["| " + " | ".join(map(cell, self.columns)) + " |", "|" + "---|" * len(self.columns),
                *("| " + " | ".join(map(cell, row)) + " |" for row in self.rows)]
