"""The one config layer underneath every settings file (run configs, auditor configs, recipes, task
packs): a strict pydantic base, validation through the one pydantic-error translator
(`errors.validation_error`), the YAML + `key.sub=value` overrides reader (through
`io.strict_yaml`: a repeated key is refused naming the file and line), and paths relative to the
file that names them.

Why one: a bad field reads the same in every file (file, field, allowed values), and a rule
fixed here (an override syntax, a relative path) is fixed for every kind of config."""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from lhd_train.errors import InputError, validation_error
from lhd_train.io.files import read_yaml_mapping, yaml_problem
from lhd_train.io.strict_yaml import load_yaml

M = TypeVar("M", bound=BaseModel)


class StrictModel(BaseModel):
    """Base of every settings model: unknown keys are errors (a typo never passes silently)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())


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
