"""The cluster-level test of the experiment's verdicts (`entitle.inference.sign_flip`) against
independent computations: every sign assignment enumerated by hand, the Monte-Carlo branch
against exact enumeration, its size under the null, and the default items over all four packs."""
from __future__ import annotations

from itertools import product

import numpy as np
import pytest

from lhd_train.entitle.inference import EXACT_MAX_TASKS, sign_flip


def enumerate_p(means: list[float]) -> float:
    """Two-sided exact p with plain Python: the share of the 2^T sign assignments whose |mean| is at
    least the observed one."""
    t = len(means)
    observed = abs(sum(means)) / t
    hits = 0
    for signs in product((1, -1), repeat=t):
        hits += abs(sum(s * m for s, m in zip(signs, means, strict=True))) / t >= observed - 1e-12
    return hits / 2 ** t


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_exact_branch_matches_enumeration(seed):
    rng = np.random.default_rng(seed)
    means = list(rng.normal(0.2, 1.0, size=9))
    res = sign_flip(means)
    assert res["p"] == pytest.approx(enumerate_p(means)) and res["n_tasks"] == 9
    assert res["method"].startswith("exact")


def test_monte_carlo_branch_is_close_to_exact():
    rng = np.random.default_rng(5)
    t = EXACT_MAX_TASKS + 2
    means = rng.normal(0.3, 1.0, size=t)
    res = sign_flip(list(means))
    assert res["method"].startswith("Monte-Carlo")
    # exact p by a bit matrix over all 2^t assignments (numpy, not the code under test)
    bits = ((np.arange(2 ** t)[:, None] >> np.arange(t)) & 1) * 2 - 1
    exact = float(np.mean(np.abs(bits @ means) / t >= abs(means.mean()) - 1e-12))
    assert abs(res["p"] - exact) < 0.01


def test_smallest_p_counts_tasks():
    assert sign_flip([0.5, 0.2, 0.1, 0.4])["p"] == pytest.approx(2 / 16)  # all one sign: 2 of 16 assignments
    assert sign_flip([0.5, 0.2, 0.1, 0.4])["min_p"] == pytest.approx(2 / 16)
    assert sign_flip([])["p"] == 1.0


def test_size_under_the_null_is_at_most_alpha():
    """Per-task means drawn symmetric around 0 (tasks of different spread, as facts differ): the test
    rejects at 0.05 about 5 % of the time (the pooled McNemar of science-5 §2.5 did 8-19 %)."""
    rng = np.random.default_rng(0)
    rejections = 0
    runs = 400
    for _ in range(runs):
        means = rng.normal(0, rng.uniform(0.1, 1.0, size=10))
        rejections += sign_flip(list(means))["p"] < 0.05
    assert rejections / runs <= 0.08


def test_default_items_span_all_four_packs():
    from lhd_train.bench.taskpack import list_builtin_packs, load_pack
    from lhd_train.entitle.run import build_all_items
    from lhd_train.entitle.settings import pack_names

    names = pack_names("all")
    assert names == list_builtin_packs() and len(names) == 4
    items, report = build_all_items([load_pack(n) for n in names], 20, 0, None)
    assert len(items) == 20 and {i.pack for i in items} == set(names)
    assert len({(i.pack, i.task) for i in items}) == 20  # spread: one fact per task first
    assert set(report) == set(names)
