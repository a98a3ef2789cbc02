"""Inference in the experiment's units: the task is the independent unit (its facts share files,
and each fact gives several cells and samples), so verdicts come from tests over tasks.

- `sign_flip`: the paired test. Each task contributes the mean of its paired differences (b - a,
  one per (fact, sample) pair); under the null hypothesis of no effect each task's mean is as
  likely negated, so the p-value is the share of sign assignments whose mean over tasks is at
  least as far from 0 as the observed one. Exact (all 2^T assignments) up to `EXACT_MAX_TASKS`
  tasks, else Monte-Carlo over 2^16 seeded sign patterns. With T tasks
  the smallest attainable two-sided p is 2 / 2^T, so fewer than 6 tasks can never reach 0.05:
  `min_p` says so beside every test (science-5 §2.5: pooled McNemar on (fact, sample) pairs had
  a type-I error of 0.08-0.19 when facts differ).

Intervals are lhd's one cluster bootstrap over tasks (`lens.stats.ratio_ci`), `BOOT_RESAMPLES` draws."""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

from lhd_train.metrics.paired_stats import EXACT_MAX as EXACT_MAX_TASKS
from lhd_train.metrics.paired_stats import sign_flip_p

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


def sign_flip(means: Sequence[float], seed: int = SEED) -> dict[str, Any]:
    """The two-sided sign-flip test of mean(means) = 0 (module doc; the p is
    `metrics.paired_stats.sign_flip_p`, scipy's permutation test): the observed mean over tasks,
    its p-value, how it was computed, the number of tasks and the smallest attainable p."""
    m = np.asarray(means, dtype=float)
    t = len(m)
    if t == 0:
        return {"mean": None, "p": 1.0, "method": "no tasks", "n_tasks": 0, "min_p": 1.0}
    method = (f"exact sign-flip over {t} tasks ({2 ** t} assignments)" if t <= EXACT_MAX_TASKS else
              f"Monte-Carlo sign-flip over {t} tasks ({2 ** EXACT_MAX_TASKS} draws, seed {seed})")
    return {"mean": float(m.mean()), "p": sign_flip_p(m, seed), "method": method, "n_tasks": t,
            "min_p": min(1.0, 2.0 / 2 ** t)}
