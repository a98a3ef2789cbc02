"""Read the Markdown tables of summary.md back as rows, for tests (a plain reader, not lhd's)."""
from __future__ import annotations

import re


def md_rows(text: str) -> list[dict[str, str]]:
    """Every row of every Markdown table in `text`, as {column title: cell}."""
    rows: list[dict[str, str]] = []
    header: list[str] | None = None
    for line in text.splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip()[1:-1])]
        if header is None:
            header = cells
        elif not set(line) <= set("|-"):
            rows.append(dict(zip(header, cells, strict=True)))
    return rows
