"""Typed errors that name the file, the field and what is allowed, and the one translator of a
pydantic `ValidationError` into them (`validation_error` for input, `data_file_error` for a file a
stage wrote), so a bad field reads the same in a config, a run record and a data file."""
from __future__ import annotations

from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, NamedTuple, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError


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


class Problem(NamedTuple):
    """The first error of a `ValidationError`, in words: the field's path (`tasks[3].files[0].type`),
    what is wrong, the allowed values where there is a short list, and how many more problems."""

    field: str | None
    problem: str
    allowed: str | None
    more: int


_TYPE_WORDS = {"model_type": "an object", "dict_type": "an object", "list_type": "a list",
               "string_type": "a string", "int_type": "an integer", "float_type": "a number",
               "bool_type": "true or false"}
_BOUNDS = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}


def field_path(loc: tuple[Any, ...]) -> str:
    """('tasks', 3, 'files', 0, 'type') -> 'tasks[3].files[0].type'."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def unwrap_optional(ann: Any) -> Any:
    """`ann` without `Annotated[...]` and without `None` in a one-type union (`int | None` -> `int`)."""
    while get_origin(ann) is Annotated:
        ann = get_args(ann)[0]
    if get_origin(ann) in (Union, UnionType):
        args = [a for a in get_args(ann) if a is not type(None)]
        if len(args) == 1:
            return unwrap_optional(args[0])
    return ann


def _annotation_at(root: type[BaseModel] | None, loc: tuple[Any, ...]) -> Any:
    ann: Any = root
    for part in loc:
        ann = unwrap_optional(ann)
        if isinstance(ann, type) and issubclass(ann, BaseModel) and isinstance(part, str):
            field = ann.model_fields.get(part)
            if field is None:
                return None
            ann = field.annotation
        elif get_origin(ann) is list and isinstance(part, int):
            ann = get_args(ann)[0]
        elif get_origin(ann) is dict:
            ann = get_args(ann)[1]
        else:
            return None
    return unwrap_optional(ann)


def explain(err: ValidationError, root: type[BaseModel] | None = None) -> Problem:
    """The first problem of `err`; `root` (the model validated) lets it name the allowed keys and
    literal values. A model-level check names its field at the start of its message
    (`"seeds: repeated seed"`): that name becomes the field."""
    e = err.errors(include_url=False)[0]
    loc, kind = tuple(e["loc"]), e["type"]
    allowed = None
    if kind == "missing":
        problem = "is required"
    elif kind == "extra_forbidden":
        problem = "unknown key"
        parent = _annotation_at(root, loc[:-1])
        if isinstance(parent, type) and issubclass(parent, BaseModel):
            allowed = ", ".join(parent.model_fields)
    elif kind == "literal_error":
        problem = f"{e['input']!r} is not allowed"
        ann = _annotation_at(root, loc)
        allowed = ", ".join(map(str, get_args(ann))) if get_origin(ann) is Literal else None
    elif kind in _BOUNDS:  # `Field(ge=1)`: "must be >= 1, got 0"
        problem = f"must be {_BOUNDS[kind]} {next(iter(e['ctx'].values()))}, got {e['input']!r}"
    elif kind in _TYPE_WORDS:
        problem = f"must be {_TYPE_WORDS[kind]} (got {type(e['input']).__name__})"
    else:
        problem = str(e["msg"]).removeprefix("Value error, ")
    where = field_path(loc) or None
    if where is None and ": " in problem and problem.split(": ", 1)[0].replace(".", "").isidentifier():
        where, problem = problem.split(": ", 1)
    return Problem(where, problem, allowed, len(err.errors()) - 1)


def validation_error(err: ValidationError, source: str | Path | None, root: type[BaseModel] | None = None
                     ) -> InputError:
    """Bad input (a config, a command line, a data file the user gives) as one InputError."""
    return InputError(source, *explain(err, root))


def data_file_error(err: ValidationError, path: str | Path, line: int | None = None, repair: str | None = None,
                    root: type[BaseModel] | None = None) -> DataFileError:
    """A record a stage wrote that does not validate, as one DataFileError naming the line and field."""
    p = explain(err, root)
    problem = p.problem + (f" (allowed: {p.allowed})" if p.allowed else "") + (
        f" (+{p.more} more problems)" if p.more else "")
    return DataFileError(path, problem, line=line, field=p.field, repair=repair)
