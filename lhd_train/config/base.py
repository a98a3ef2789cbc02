"""The one config layer underneath every settings file (run configs, auditor configs, recipes, task
packs): a strict pydantic base, the one pydantic-error -> InputError translator, the YAML +
`key.sub=value` overrides reader (through `io.strict_yaml`: a repeated key is refused naming the
file and line), and paths relative to the file that names them.

Why one: a bad field reads the same in every file (file, field, allowed values), and a rule
fixed here (an override syntax, a relative path) is fixed for every kind of config."""
from __future__ import annotations

import copy
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, TypeVar, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from lhd_train.errors import InputError
from lhd_train.io.files import read_yaml_mapping, yaml_problem
from lhd_train.io.strict_yaml import load_yaml

M = TypeVar("M", bound=BaseModel)


class StrictModel(BaseModel):
    """Base of every settings model: unknown keys are errors (a typo never passes silently)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())



def _unwrap(ann: Any) -> Any:
    while get_origin(ann) is Annotated:
        ann = get_args(ann)[0]
    if get_origin(ann) in (Union, UnionType):
        args = [a for a in get_args(ann) if a is not type(None)]
        if len(args) == 1:
            return _unwrap(args[0])
    return ann


def _annotation_at(root: type[BaseModel], loc: tuple[Any, ...]) -> Any:
    ann: Any = root
    for part in loc:
        ann = _unwrap(ann)
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
    return _unwrap(ann)


def field_path(loc: tuple[Any, ...]) -> str:
    """('tasks', 3, 'files', 0, 'type') -> 'tasks[3].files[0].type'."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


_TYPE_WORDS = {"model_type": "an object", "dict_type": "an object", "list_type": "a list",
               "string_type": "a string", "int_type": "an integer", "float_type": "a number",
               "bool_type": "true or false"}
_BOUNDS = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}


def validation_error(err: ValidationError, source: str | Path | None, root: type[BaseModel]) -> InputError:
    """Turn the first pydantic error into one InputError with a readable field path and allowed values.

    A model-level check names its field at the start of its message (`"seeds: repeated seed"`);
    that name becomes the field. More problems than the first are counted in the message."""
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
    return InputError(source, where, problem, allowed, more=len(err.errors()) - 1)


def validate(model: type[M], data: Any, source: str | Path | None) -> M:
    """`model.model_validate(data)`, with a failure raised as `validation_error`."""
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise validation_error(err, source, model) from None


# ---------------------------------------------------------------- YAML + overrides

def _set_path(data: dict[str, Any], dotted: str, value: Any, source: str) -> None:
    keys = dotted.split(".")
    cur: Any = data
    for k in keys[:-1]:
        if not isinstance(cur, dict):
            raise InputError(source, dotted, "cannot descend into a non-mapping value")
        cur = cur.setdefault(k, {})
    if not isinstance(cur, dict):
        raise InputError(source, dotted, "cannot set a key on a non-mapping value")
    cur[keys[-1]] = value


def parse_assignment(item: str, flag: str | None = None) -> tuple[str, Any]:
    """One `key=value` from the command line: (key, value parsed as YAML: `4`, `[a, b]`, `null`).
    Errors name `flag` and the key (`--var shards`) when a flag is given, else the key itself."""
    if "=" not in item or item.startswith("="):
        if flag:
            raise InputError("command line", flag, f"'{item}' must look like key=value")
        raise InputError("command line", item, "an override must look like key.sub=value")
    key, raw = item.split("=", 1)
    key = key.strip()
    try:
        value = load_yaml(raw) if raw != "" else ""
    except (ValueError, yaml.YAMLError) as e:
        raise InputError("command line", f"{flag} {key}" if flag else key,
                         f"value is not valid YAML: {yaml_problem(e)}") from None
    return key, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """`a.b=value` pairs; values are parsed as YAML scalars/lists (`seeds=[1,2]`, `x=null`)."""
    out = copy.deepcopy(data)
    for item in overrides:
        key, value = parse_assignment(item)
        _set_path(out, key, value, "command line")
    return out


def read_config(path: str | Path, overrides: list[str] | None = None, what: str = "config file") -> dict[str, Any]:
    """A YAML mapping from `path` with `key.sub=value` overrides applied, ready to validate."""
    return apply_overrides(read_yaml_mapping(path, what), overrides or [])


def relative_to_file(value: str, config_path: str | Path) -> str:
    """A relative path that exists next to the config file names that file's neighbour (configs
    travel with their models); anything else is kept as written."""
    p = Path(value)
    base = Path(config_path).parent
    if not p.is_absolute() and (base / p).exists():
        return str((base / p).resolve())
    return value
