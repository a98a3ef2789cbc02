"""Typed errors that name the file, the field and what is allowed."""
from __future__ import annotations

from pathlib import Path


class LhdError(Exception):
    """Base class: everything the CLI turns into a clean one-line message (no traceback)."""


class InputError(LhdError):
    """Bad user input: a config, override, task pack or data file that does not validate."""

    def __init__(self, source: str | Path | None, field: str | None, problem: str, allowed: str | None = None,
                 more: int = 0):
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
        if more:  # further problems found in the same input
            msg += f" (+{more} more problems)"
        super().__init__(msg)


class DataFileError(LhdError):
    """A file a stage wrote that cannot be used as it is: a line that is not JSON, a row without
    a field every reader needs, a round written twice, a marker that disagrees with its rows.

    Readers never change such a file (a guess at a repair could lose data silently); the message
    names the file, the line and the field, and says how to repair it when a repair is safe."""

    def __init__(self, path: str | Path, problem: str, line: int | None = None, field: str | None = None,
                 repair: str | None = None):
        self.path, self.line, self.field, self.problem, self.repair = str(path), line, field, problem, repair
        where = self.path
        if line is not None:
            where += f": line {line}"
        if field:
            where += f": field '{field}'"
        super().__init__(f"{where}: {problem}" + (f"; repair: {repair}" if repair else ""))
