"""The errors of the lens package: one line naming the file, the field and what is allowed.

The library knows nothing of lhd (as `rollouts/` raises its own `BackendError`): the `lhd`
command's error boundary (`lhd_train/cli/boundary.py`) prints a `LensError` as one line
instead of a traceback."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from pydantic import BaseModel, ValidationError


class LensError(Exception):
    """Bad input or an inconsistent lens/model/probe combination, with a message that says what to do."""


class LensFileError(LensError):
    """A file the lens reads that cannot be used as it is (a corpus line, a sidecar): the message
    names the file, the line and the field."""

    def __init__(self, path: str | Path, problem: str, line: int | None = None, field: str | None = None):
        self.path, self.problem, self.line, self.field = str(path), problem, line, field
        where = self.path + (f": line {line}" if line is not None else "") + (f": field '{field}'" if field else "")
        super().__init__(f"{where}: {problem}")


_TYPES = {"string_type": "a string", "int_type": "an integer", "int_parsing": "an integer", "float_type": "a number",
          "float_parsing": "a number", "list_type": "a list", "dict_type": "an object", "model_type": "an object",
          "bool_type": "true or false"}


def record_error(exc: ValidationError, path: str | Path, root: type[BaseModel]) -> LensFileError:
    """The first problem of a record that does not validate (`root`, the model), in words: a missing
    field, a value outside a literal's list (naming the allowed ones), or a value of the wrong type."""
    e = exc.errors(include_url=False)[0]
    loc = [str(p) for p in e["loc"]]
    if e["type"] == "missing":
        problem = "is required"
    elif e["type"] == "literal_error":
        ann: Any = root.model_fields[loc[0]].annotation if len(loc) == 1 and loc[0] in root.model_fields else None
        allowed = [str(a) for a in get_args(ann) if a is not None and get_origin(ann) is Literal]
        problem = f"{e['input']!r} is not allowed" + (f" (allowed: {', '.join(allowed)})" if allowed else "")
    elif e["type"] in _TYPES:
        problem = f"must be {_TYPES[e['type']]} (got {type(e['input']).__name__})"
    else:
        problem = str(e["msg"]).removeprefix("Value error, ")
    return LensFileError(path, problem, field=".".join(loc) or None)
