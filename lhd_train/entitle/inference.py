"""Inference in the experiment's units: the task is the independent unit (its facts share files,
and each fact gives several cells and samples), so verdicts come from tests over tasks.

- `sign_flip`: the paired test. Each task contributes the mean of its paired differences (b - a,
  one per (fact, sample) pair); under the null hypothesis of no effect each task's mean is as
  likely negated, so the p-value is the share of sign assignments whose mean over tasks is at
  least as far from 0 as the observed one. Exact (all 2^T assignments) up to `EXACT_MAX_TASKS`
  tasks, else Monte-Carlo with `DRAWS` seeded draws (p = (1 + hits) / (1 + draws)). With T tasks
  the smallest attainable two-sided p is 2 / 2^T, so fewer than 6 tasks can never reach 0.05:
  `min_p` says so beside every test (science-5 §2.5: pooled McNemar on (fact, sample) pairs had
  a type-I error of 0.08-0.19 when facts differ).

Intervals are lhd's one cluster bootstrap over tasks (`lens.stats.ratio_ci`), `BOOT_RESAMPLES` draws."""
from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

EXACT_MAX_TASKS = 16
DRAWS = 20_000
SEED = 0
BOOT_RESAMPLES = 2000
BOOT_SEED = 0


def task_means(diffs: Sequence[float], tasks: Sequence[Hashable]) -> dict[Hashable, float]:
    """Each task's mean paired difference, tasks in first-seen order."""
    sums: dict[Hashable, list[float]] = {}
    for d, t in zip(diffs, tasks, strict=True):
        s = sums.setdefault(t, [0.0, 0.0])
        s[0] += float(d)
        s[1] += 1
    return {t: s[0] / s[1] for t, s in sums.items()}


def sign_flip(means: Sequence[float], draws: int = DRAWS, seed: int = SEED) -> dict[str, Any]:
    """The two-sided sign-flip test of mean(means) = 0 (module doc): the observed mean over tasks,
    its p-value, how it was computed, the number of tasks and the smallest attainable p."""
    m = np.asarray(means, dtype=float)
    t = len(m)
    if t == 0:
        return {"mean": None, "p": 1.0, "method": "no tasks", "n_tasks": 0, "min_p": 1.0}
    observed = abs(m.mean())
    tol = 1e-12 * max(1.0, float(np.abs(m).max()))
    if t <= EXACT_MAX_TASKS:
        signs = np.array(list(itertools.product((1.0, -1.0), repeat=t)))
        stats = np.abs(signs @ m) / t
        p = float(np.mean(stats >= observed - tol))
        method = f"exact sign-flip over {t} tasks ({len(signs)} assignments)"
    else:
        rng = np.random.default_rng(seed)
        signs = rng.choice((1.0, -1.0), size=(draws, t))
        hits = int(np.sum(np.abs(signs @ m) / t >= observed - tol))
        p = (1 + hits) / (1 + draws)
        method = f"Monte-Carlo sign-flip over {t} tasks ({draws} draws, seed {seed})"
    return {"mean": float(m.mean()), "p": min(1.0, p), "method": method, "n_tasks": t,
            "min_p": min(1.0, 2.0 / 2 ** t)}
