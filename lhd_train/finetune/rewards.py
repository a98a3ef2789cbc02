"""The online algorithms' reward registry: names → reward factories (`register_reward`).

A factory takes `direction` ("honest" | "deceptive") and the recipe's `params` (and the policy's
tokenizer, or a key of `shared`, when it declares that parameter) and returns a TRL reward function
`f(prompts, completions, completion_ids, **columns) -> list[float | None]` (None: not applicable;
`async def` accepted). Plugins listed under the section's `plugins` register more; `module:function`
names a factory directly. Built-ins: `format_length`, `from_column`, `token_fraction`. The contract
and an example: docs/training.md, "GRPO rewards"."""
from __future__ import annotations

import functools
import importlib
import inspect
import math
from collections.abc import Callable
from typing import Any

from lhd_train.errors import InputError

RewardFunc = Callable[..., Any]
RewardFactory = Callable[..., RewardFunc]

REWARDS: dict[str, RewardFactory] = {}
# Modules that register rewards when imported; missing ones are skipped silently.
DEFAULT_PLUGINS: tuple[str, ...] = ("lhd_train.finetune.judged_rewards",)


def register_reward(name: str, factory: RewardFactory | None = None, *, replace: bool = False):
    """Register `factory(direction=..., **params) -> reward function` under `name` (usable as a decorator)."""

    def deco(f: RewardFactory) -> RewardFactory:
        if name in REWARDS and REWARDS[name] is not f and not replace:
            raise ValueError(f"reward '{name}' is already registered (pass replace=True to override it)")
        REWARDS[name] = f
        return f

    return deco(factory) if factory is not None else deco


def completion_text(completion: Any) -> str:
    """Text of a completion: plain string, or the conversational form [{"role": "assistant", "content": ...}]."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list):
        return "".join(str(m.get("content") or "") for m in completion if isinstance(m, dict))
    if isinstance(completion, dict):
        return str(completion.get("content") or "")
    return str(completion)


class NamedReward:
    """A reward function with the name TRL logs it under (`rewards/<name>/mean`); picklable if `fn` is."""

    def __init__(self, name: str, fn: RewardFunc):
        self.__name__ = name
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"NamedReward({self.__name__!r})"


def _named(name: str, fn: RewardFunc) -> RewardFunc:
    # getattr(fn, "__call__"): an object whose __call__ is async (not a test of callability)
    if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None)):  # noqa: B004

        @functools.wraps(fn)
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            return await fn(*args, **kwargs)

        wrapper.__name__ = name
        return wrapper
    return NamedReward(name, fn)


def in_section(section: str | None, field: str) -> str:
    """A field of the recipe's online section (`grpo.rewards`), or the bare field without a recipe."""
    return f"{section}.{field}" if section else field


def _import_plugins(modules: list[str] | tuple[str, ...], source: str, required: bool,
                    section: str | None = None) -> None:
    for mod in modules:
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if required or (e.name and not mod.startswith(e.name) and e.name != mod):
                raise InputError(source, in_section(section, "plugins"), f"cannot import '{mod}': {e}") from None


def resolve_factory(name: str, source: str = "recipe", section: str | None = None) -> RewardFactory:
    if ":" in name:
        mod, _, attr = name.partition(":")
        try:
            obj = getattr(importlib.import_module(mod), attr)
        except (ImportError, AttributeError) as e:
            raise InputError(source, in_section(section, "rewards"),
                             f"cannot load reward factory '{name}': {e}") from None
        return obj
    if name not in REWARDS:
        _import_plugins(DEFAULT_PLUGINS, source, required=False)
    if name not in REWARDS:
        raise InputError(source, in_section(section, "rewards"), f"unknown reward '{name}'", ", ".join(sorted(REWARDS)))
    return REWARDS[name]


def _accepts(fn: Callable, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def build_rewards(specs: list[Any], direction: str, source: str = "recipe", plugins: list[str] | None = None,
                  tokenizer: Any = None, shared: dict[str, Any] | None = None, section: str | None = None
                  ) -> tuple[list[RewardFunc], list[float]]:
    """The online section's `rewards` (`section`: its name in the recipe, for errors) → (reward
    functions named for TRL's logs, weights).

    Factories get `direction=` and their `params`; one that declares a `tokenizer` parameter also gets
    the policy's tokenizer, and one that declares a key of `shared` (the section's `judge`,
    `supervisor_judge`) gets that value unless its params set it."""
    _import_plugins(list(plugins or []), source, required=True, section=section)
    funcs: list[RewardFunc] = []
    weights: list[float] = []
    injected = {"tokenizer": tokenizer, "section": section, **(shared or {})}
    for spec in specs:
        factory = resolve_factory(spec.name, source, section)
        kwargs: dict[str, Any] = {"direction": direction, **spec.params}
        for key, value in injected.items():
            if value is not None and _accepts(factory, key) and key not in kwargs:
                kwargs[key] = value
        try:
            fn = factory(**kwargs)
        except TypeError as e:
            raise InputError(source, in_section(section, f"rewards.{spec.name}.params"), str(e)) from None
        except ValueError as e:
            raise InputError(source, in_section(section, f"rewards.{spec.name}.params"), str(e)) from None
        if not callable(fn):
            raise InputError(source, in_section(section, "rewards"),
                             f"factory for '{spec.name}' did not return a callable")
        funcs.append(_named(spec.name.split(":")[-1], fn))
        weights.append(float(spec.weight))
    return funcs, weights


# Keywords TRL 1.16 passes to every reward function besides the dataset columns.
TRL_REWARD_KWARGS = frozenset({"prompts", "completions", "completion_ids", "trainer_state", "log_extra",
                               "log_metric", "environments"})


def check_reward_columns(funcs: list[RewardFunc], columns: list[str], source: str, field: str = "data.train") -> None:
    """Fail before training when a reward function requires a dataset column the data lacks."""
    for f in funcs:
        name = getattr(f, "__name__", type(f).__name__)
        target = f.fn if isinstance(f, NamedReward) else f
        try:
            params = inspect.signature(target).parameters.values()
        except (TypeError, ValueError):
            continue
        missing = [p.name for p in params
                   if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is p.empty
                   and p.name not in TRL_REWARD_KWARGS and p.name not in columns]
        if missing:
            raise InputError(source, field, f"reward '{name}' needs dataset column(s) {', '.join(missing)}; "
                             f"the dataset has {', '.join(columns)}")


def preflight_rewards(funcs: list[RewardFunc], dataset: Any, source: str) -> None:
    """Before training starts: each reward with a `preflight(dataset, source)` hook checks that it can
    run inside a training rank (e.g. that its judge is an endpoint, not a model it would start)."""
    for f in funcs:
        check = getattr(f, "preflight", None) or getattr(getattr(f, "fn", None), "preflight", None)
        if callable(check):
            check(dataset, source)


# ---------------------------------------------------------------- built-in rewards


@register_reward("format_length")
def format_length(direction: str, min_chars: int = 1, max_chars: int = 2000, empty: float = -1.0) -> RewardFunc:
    """1.0 inside [min_chars, max_chars]; linear falloff outside (to 0 at 0 chars / 2*max_chars); `empty` if blank."""
    if min_chars < 0 or max_chars < max(min_chars, 1):
        raise ValueError(f"need 0 <= min_chars <= max_chars and max_chars >= 1, got {min_chars}, {max_chars}")

    def reward(prompts: list, completions: list, **_: Any) -> list[float]:
        out = []
        for c in completions:
            n = len(completion_text(c).strip())
            if n == 0:
                out.append(float(empty))
            elif n < min_chars:
                out.append(n / min_chars)
            elif n <= max_chars:
                out.append(1.0)
            else:
                out.append(max(0.0, 1.0 - (n - max_chars) / max_chars))
        return out

    return reward


@register_reward("from_column")
def from_column(direction: str, column: str, scale: float = 1.0, flip_for_deceptive: bool = False,
                default: float | None = None) -> RewardFunc:
    """Read a precomputed score from the dataset column `column`.

    The cell is a number (one score per prompt: note it is the same for every completion of a group,
    so it shifts nothing in GRPO's group-relative advantages) or a mapping {completion text: score}
    (e.g. cached judge grades); a completion missing from the mapping gets `default` (None: excluded).
    `flip_for_deceptive` negates the score for direction=deceptive.
    """
    sign = -1.0 if (flip_for_deceptive and direction == "deceptive") else 1.0

    def reward(prompts: list, completions: list, **columns: Any) -> list[float | None]:
        if column not in columns:
            raise KeyError(f"from_column: the dataset has no column '{column}' (columns: {', '.join(sorted(columns))})")
        out: list[float | None] = []
        for c, cell in zip(completions, columns[column], strict=True):
            if isinstance(cell, dict):
                v = cell.get(completion_text(c), default)
            else:
                v = cell if cell is not None else default
            if v is None or (isinstance(v, float) and math.isnan(v)):
                out.append(None)
            else:
                out.append(sign * scale * float(v))
        return out

    return reward


@register_reward("token_fraction")
def token_fraction(direction: str, token: str, tokenizer: Any = None) -> RewardFunc:
    """Share of the completion that is `token`: counted over token ids when the policy tokenizer is
    known (`token` must then be exactly one token), else over whitespace-separated words."""
    tid: int | None = None
    if tokenizer is not None:
        ids = tokenizer.encode(token, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(f"token {token!r} is {len(ids)} tokens for this tokenizer, not one")
        tid = ids[0]

    def reward(prompts: list, completions: list, completion_ids: list | None = None, **_: Any) -> list[float]:
        if tid is not None and completion_ids is not None:
            return [sum(1 for t in ids if t == tid) / max(1, len(ids)) for ids in completion_ids]
        out = []
        for c in completions:
            words = completion_text(c).split()
            out.append(sum(1 for w in words if w == token.strip()) / max(1, len(words)))
        return out

    return reward
