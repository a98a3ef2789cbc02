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

from filekit import FORMULA_START as FORMULA_START  # re-exported: the one rule, shared with lens
from filekit import safe_cell as safe_cell
from filekit import safe_frame
from lhd_train.io.files import atomic_write_text


def write_csv(df: Any, path: Path) -> Path:
    """`df` as a CSV table (no index), cells made safe, written atomically."""
    atomic_write_text(Path(path), safe_frame(df).to_csv(index=False))
    return Path(path)
