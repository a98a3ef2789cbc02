"""CSV tables that a spreadsheet opens as data: no cell runs as a formula.

A cell starting with `=`, `+`, `-` or `@` (or a tab or carriage return in front of one) is a
formula to Excel, LibreOffice and Google Sheets, and model text lands in our tables (trial ids,
task titles, answers, reasoning): `=HYPERLINK(...)` from a performer would run when the report's
table is opened. Such a text cell is written with a leading `'` (the spreadsheets' own "this is
text" mark); numbers stay numbers. Lone UTF-16 surrogates are shown as U+FFFD, so the file is
valid UTF-8. Every CSV writer goes through `write_csv`."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from lhd_train.io.files import atomic_write_text, printable

FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def safe_cell(value: Any) -> Any:
    """A text cell that cannot start a formula; anything else unchanged."""
    if not isinstance(value, str):
        return value
    value = printable(value)
    return "'" + value if value.startswith(FORMULA_START) else value


def safe_frame(df: Any) -> Any:
    """A copy of a pandas DataFrame whose text cells (and column names) pass through `safe_cell`."""
    out = df.copy()
    for col in out.columns:
        if out[col].dtype == object or str(out[col].dtype) in ("string", "str"):
            out[col] = out[col].map(safe_cell)
    out.columns = [safe_cell(c) for c in out.columns]
    return out


def write_csv(df: Any, path: Path) -> Path:
    """`df` as a CSV table (no index), cells made safe, written atomically."""
    atomic_write_text(Path(path), safe_frame(df).to_csv(index=False))
    return Path(path)
