"""Typed errors that name the file, the field and what is allowed."""
from __future__ import annotations

from pathlib import Path


class LhdError(Exception):
    """Base class: everything the CLI turns into a clean one-line message (no traceback)."""


class InputError(LhdError):
    """Bad user input: a config, override, task pack or data file that does not validate."""

    def __init__(self, source: str | Path | None, field: str | None, problem: str, allowed: str | None = None):
        self.source = str(source) if source is not None else None
        self.field = field
        self.problem = problem
        self.allowed = allowed
        where = self.source or "<input>"
        if field:
            where += f": field '{field}'"
        msg = f"{where}: {problem}"
        if allowed:
            msg += f" (allowed: {allowed})"
        super().__init__(msg)
