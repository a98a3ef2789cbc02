"""Typer commands whose options are a pydantic settings model: one declaration per command (used
by `lhd_train.cli` and by the lens commands, hence outside the cli package, which mounts them).

`@settings_command(Model)` under `@app.command()` gives the command one option per field of
`Model` (its type, its default, `Field(description=...)` as help, a Literal's values as choices;
naming rules in `lhd_train.config.flags`), validates the parsed values into `Model` and calls the
function with it. Bounds and cross-field checks are the model's own, so the same values from a
YAML file or a Slurm variable are checked the same way; a value the model refuses ends as one
`InputError` that names the flag and what is allowed (through `errors.validation_error`)."""
from __future__ import annotations

import inspect
from collections.abc import Callable, Collection, Mapping
from typing import Any, TypeVar

import typer
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from lhd_train.config.flags import cli_fields, flag_for, flag_of, is_argument, negated
from lhd_train.errors import InputError, validation_error

M = TypeVar("M", bound=BaseModel)
R = TypeVar("R")


def parse_settings(model: type[M], values: Mapping[str, Any], source: str = "command line") -> M:
    """`values` (flag values by field name) validated into `model`; a refused value raises an
    InputError naming its flag. A None from typer (a list or argument not given) means the default."""
    given = {k: v for k, v in values.items()
             if v is not None or model.model_fields[k].get_default(call_default_factory=True) is None}
    try:
        return model.model_validate(given)
    except ValidationError as err:
        e = validation_error(err, source, model)
        raise InputError(source, flag_for(model, e.field), e.problem, e.allowed,
                         more=len(err.errors()) - 1) from None


#: numbers the parser passes on as text, so the model's own validation refuses `--facts 2.5` in one
#: line naming the flag (the parser's refusal is a usage box); the help still names the type
NUMBERS: dict[Any, str] = {int: "INTEGER", float: "FLOAT", int | None: "INTEGER", float | None: "FLOAT"}


def _number(text: Any, annotation: Any) -> Any:
    """A number option's text as its number when it reads as one; else as given, for the model to refuse."""
    kind = int if NUMBERS.get(annotation) == "INTEGER" else float
    if not isinstance(text, str):
        return text
    try:
        return kind(text)
    except ValueError:
        return text


def _parameter(name: str, info: FieldInfo) -> inspect.Parameter:
    default = ... if info.is_required() else info.get_default(call_default_factory=True)
    help_text = info.description
    flag = flag_of(name, info)
    metavar = NUMBERS.get(info.annotation) if not is_argument(info) else None
    if metavar is not None:
        param = typer.Option(default, flag, help=help_text, metavar=metavar)
        text = str if info.annotation in (int, float) else str | None
        return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=param, annotation=text)
    if is_argument(info):
        param = typer.Argument(None if default == [] else default, help=help_text, show_default=default != [])
    elif info.annotation is bool and flag.startswith("--no-"):  # a switch that turns something off
        param = typer.Option(default, flag, help=help_text)
    elif info.annotation is bool:
        param = typer.Option(default, f"{flag}/{negated(flag)}", help=help_text)
    else:
        param = typer.Option(default, flag, help=help_text)
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=param, annotation=info.annotation)


def settings_command(model: type[M], *,
                     exclude: Collection[str] = ()) -> Callable[[Callable[[M], R]], Callable[..., R]]:
    """Decorate `def cmd(settings: Model)` into a typer callback taking every field of `model` (but
    `exclude`, which keep their defaults) as an option or argument."""
    fields = cli_fields(model, exclude)
    params = [_parameter(name, info) for name, info in fields.items()]

    def wrap(fn: Callable[[M], R]) -> Callable[..., R]:
        def command(**values: Any) -> R:
            numbers = {k: _number(v, fields[k].annotation) for k, v in values.items()
                       if fields[k].annotation in NUMBERS}
            return fn(parse_settings(model, {**values, **numbers}))

        command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]  # what typer reads
        command.__annotations__ = {p.name: p.annotation for p in params}
        command.__name__, command.__qualname__, command.__doc__ = fn.__name__, fn.__qualname__, fn.__doc__
        command.__module__ = fn.__module__
        return command

    return wrap
