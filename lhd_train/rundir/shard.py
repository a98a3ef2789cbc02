"""Deterministic sharding of a run's trial grid (`lhd run CONFIG --shard i/n`).

A shard is a contiguous, balanced block of the run's `(seed, trial_id)` list, the same split
`lhd lens fit --shard i/n` uses for prompts (`lhd_train/cli/lens.py` calls `shard_bounds` here): shard
sizes differ by at most one, every item is in exactly one shard, and concatenating the shards in
index order gives the original list back (so a merged run lists its seeds in the config's order)."""
from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, TypeVar

from lhd_train.errors import InputError

T = TypeVar("T")
SHARD_SUFFIX = re.compile(r"-shard(\d+)of(\d+)$")


def parse_shard(spec: str) -> tuple[int, int]:
    """`"i/n"` → `(i, n)` with 0-based `i`, `0 <= i < n`. Bad input raises InputError."""
    text = str(spec).strip()
    m = re.fullmatch(r"(\d+)\s*/\s*(\d+)", text)
    if not m:
        raise InputError("command line", "--shard", f"'{spec}' is not a shard spec",
                         "INDEX/COUNT with a 0-based INDEX, e.g. 0/4 ... 3/4")
    i, n = int(m.group(1)), int(m.group(2))
    if n < 1:
        raise InputError("command line", "--shard", f"'{spec}': the shard count must be at least 1")
    if i >= n:
        raise InputError("command line", "--shard", f"'{spec}': the index is 0-based, so it must be below {n}",
                         f"0/{n} ... {n - 1}/{n}")
    return i, n


def shard_bounds(length: int, i: int, n: int) -> tuple[int, int]:
    """`[start, end)` of shard `i` of `n` over `length` items (sizes differ by at most one)."""
    if n < 1 or not 0 <= i < n:
        raise InputError("command line", "--shard", f"shard {i} of {n} is not valid (need 0 <= index < count)")
    if length < 0:
        raise ValueError("length must be >= 0")
    return (length * i) // n, (length * (i + 1)) // n


def shard_items(items: Sequence[T], i: int, n: int) -> list[T]:
    """The items of shard `i` of `n`: a contiguous block; blocks are balanced and disjoint and
    cover `items` exactly once. A shard of a list shorter than `n` may be empty."""
    a, b = shard_bounds(len(items), i, n)
    return list(items[a:b])


def shard_run_name(run_name: str, i: int, n: int) -> str:
    """The run name of one shard: `<run_name>-shard<i>of<n>` (its own run directory)."""
    return f"{run_name}-shard{i}of{n}"


def parse_shard_run_name(run_name: str) -> tuple[str, int, int] | None:
    """`x-shard2of4` → `("x", 2, 4)`; None when the name carries no shard suffix."""
    m = SHARD_SUFFIX.search(run_name)
    if not m:
        return None
    return run_name[: m.start()], int(m.group(1)), int(m.group(2))


def shard_config(cfg: Any, i: int, n: int) -> Any:
    """A copy of a RunConfig restricted to shard `i` of `n`: explicit `seeds` (this shard's block
    of `cfg.trial_seeds()`), `num_trials` unset, `run_name` = `shard_run_name(...)`.

    Running `run_benchmark(shard_config(cfg, i, n))` writes exactly what the sharded engine must
    write; `merge_runs` ignores the fields this changes. Raises InputError for an empty shard."""
    seeds = shard_items(cfg.trial_seeds(), i, n)
    if not seeds:
        raise InputError("command line", "--shard",
                         f"shard {i}/{n} of {len(cfg.trial_seeds())} trials is empty; use at most "
                         f"{len(cfg.trial_seeds())} shards")
    return cfg.model_copy(update={"seeds": seeds, "num_trials": None,
                                  "run_name": shard_run_name(cfg.run_name, i, n)}, deep=True)
