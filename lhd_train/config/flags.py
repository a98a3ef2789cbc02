"""A settings model's command-line form: which flag each field is, and the argv of a model's values.

One model declares a command's options (type, default, bounds, help); `lhd_train.cli.options`
turns it into typer options, and the Slurm planners render a job's command line with `to_argv`,
so the flags a job runs with cannot drift from what the command accepts. Pure pydantic: no typer.

Field conventions, in `Field(json_schema_extra={...})`:
- `"flag": "--auditor"`: the flag's name when it is not `--field-name`;
- `"argument": True`: a positional argument (a list field takes the remaining words);
- `"cli": False`: not on the command line (a library-only knob, such as a test's stop switch)."""
from __future__ import annotations

from collections.abc import Collection
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo


def _extra(info: FieldInfo) -> dict[str, Any]:
    return info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}


def cli_fields(model: type[BaseModel], exclude: Collection[str] = ()) -> dict[str, FieldInfo]:
    """The fields of `model` that are flags or arguments, in declaration order."""
    return {n: f for n, f in model.model_fields.items() if n not in exclude and _extra(f).get("cli", True)}


def is_argument(info: FieldInfo) -> bool:
    return bool(_extra(info).get("argument"))


def flag_of(name: str, info: FieldInfo) -> str:
    """`--n-prompts` for `n_prompts` (or the field's own `flag`); `RUN_DIR` for an argument."""
    if is_argument(info):
        return name.upper()
    return str(_extra(info).get("flag") or "--" + name.replace("_", "-"))


def flag_for(model: type[BaseModel], field: str | None) -> str | None:
    """The flag of a field path from a validation error (`n_prompts`, `overrides[2]`); as given when
    it is no field of `model` (a model-level check that names something else)."""
    if field is None:
        return None
    name = field.split(".")[0].split("[")[0]
    info = model.model_fields.get(name)
    return flag_of(name, info) if info is not None else field


def negated(flag: str) -> str:
    """`--no-resume` for `--resume`: how a bool flag says False."""
    return "--no-" + flag.removeprefix("--")


def to_argv(settings: BaseModel, *, exclude: Collection[str] = (), changed_only: bool = True) -> list[str]:
    """The command-line words that give `settings` to its command: arguments first, then one flag
    per option (`changed_only`: only values that differ from the default, so the command's own
    default applies and reads the same as typing nothing). A None where the default is not None
    has no flag and is refused."""
    args: list[str] = []
    opts: list[str] = []
    for name, info in cli_fields(type(settings), exclude).items():
        value = getattr(settings, name)
        if changed_only and not info.is_required() and value == info.get_default(call_default_factory=True):
            continue
        flag = flag_of(name, info)
        if is_argument(info):
            args += [str(v) for v in value] if isinstance(value, list | tuple) else [str(value)]
        elif value is None:
            raise ValueError(f"{name}: no flag gives None (the default is {info.default!r})")
        elif isinstance(value, bool):
            opts.append(flag if value else negated(flag))
        elif isinstance(value, list | tuple):
            for v in value:
                opts += [flag, str(v)]
        else:
            opts += [flag, str(value)]
    return args + opts
