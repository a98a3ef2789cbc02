"""Issue 37 item 4: lhd's one cluster bootstrap (`lens.stats.cluster_bootstrap`), checked against a plain
resampling loop scored by sklearn and scipy, and its policy for a resample without a class."""
from __future__ import annotations

import numpy as np
import pytest
from scipy import stats as sps
from sklearn.metrics import roc_auc_score

from lens.paired_auroc import paired_auroc
from lens.stats import MIN_DEFINED, bootstrap_auroc, cluster_bootstrap, ratio_ci, weighted_auroc
from lhd_train.audit.detectability import trial_bootstrap


def _data(n_clusters: int = 12, seed: int = 3):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 6, n_clusters)
    clusters = np.repeat([f"t{i}" for i in range(n_clusters)], sizes)
    y = rng.random(len(clusters)) < 0.4
    scores = rng.normal(size=len(y)) + 0.8 * y
    return scores, y, clusters


def _plain_loop(clusters, n_boot, seed, score):
    """The textbook cluster bootstrap: draw K clusters with replacement, stack their rows, score the stack."""
    text = np.asarray(clusters).astype(str)
    names = sorted(set(text.tolist()))  # clusters in the order of their text, as `cluster_counts` numbers them
    members = [np.flatnonzero(text == c) for c in names]
    draws = np.random.default_rng(seed).integers(0, len(names), size=(n_boot, len(names)))
    return np.array([score(np.concatenate([members[i] for i in row])) for row in draws])


def test_the_auroc_resamples_are_those_of_a_plain_loop_scored_by_sklearn():
    s, y, cl = _data()

    def sk(idx):
        return roc_auc_score(y[idx], s[idx]) if 0 < y[idx].sum() < len(idx) else np.nan

    plain = _plain_loop(cl, 300, 7, sk)
    seen = []
    ci = cluster_bootstrap(lambda w: seen.append(weighted_auroc(s, y, w)) or seen[-1], cl, n_boot=300, seed=7)
    assert np.allclose(np.concatenate(seen), plain, equal_nan=True)
    ok = plain[np.isfinite(plain)]
    assert ci == pytest.approx(tuple(np.quantile(ok, [0.025, 0.975])))
    lens_ci = bootstrap_auroc(s, y, cl, n_boot=300, seed=7)
    assert (lens_ci.lo, lens_ci.hi) == pytest.approx(ci)  # the lens's AUROC interval
    assert trial_bootstrap(y, s, cl, seed=7, n=300) == pytest.approx(ci)  # the planted-answer control's


def test_a_pooled_ratio_matches_a_plain_loop_and_scipys_bootstrap():
    rng = np.random.default_rng(0)
    num, den = rng.poisson(3, 40).astype(float), rng.integers(1, 6, 40).astype(float)
    cl = np.repeat(np.arange(10), 4)
    plain = _plain_loop(cl, 500, 1, lambda idx: num[idx].sum() / den[idx].sum())
    assert ratio_ci(num, den, cl, n_boot=500, seed=1) == pytest.approx(tuple(np.quantile(plain, [0.025, 0.975])))
    # one cluster per unit is scipy's (paired) bootstrap of the same statistic; the draws differ, the law does not
    ours = ratio_ci(num, den, n_boot=20_000, seed=2)
    ref = sps.bootstrap((num, den), lambda a, b, axis=-1: a.sum(axis) / b.sum(axis), paired=True, vectorized=True,
                        n_resamples=20_000, method="percentile", random_state=np.random.default_rng(2))
    assert ours == pytest.approx((ref.confidence_interval.low, ref.confidence_interval.high), abs=0.03)


def test_a_resample_without_a_class_is_dropped_and_too_many_mean_no_interval():
    """Policy: undefined resamples are left out; fewer than MIN_DEFINED of them defined: no interval."""
    y = np.array([True, False, False, False, False, False])
    s = np.array([0.9, 0.1, 0.2, 0.3, 0.4, 0.5])
    cl = np.array(["a", "b", "c", "d", "e", "f"])  # the one positive is one cluster of six: 1 - (5/6)^6 = 67 % hold it
    assert cluster_bootstrap(lambda w: weighted_auroc(s, y, w), cl, n_boot=400, seed=0) == (1.0, 1.0)

    def defined_when(drawn: int):  # defined only where cluster "a" is drawn at least `drawn` times
        return lambda w: np.where(w[:, 0] >= drawn, w.sum(1), np.nan)

    share_once, share_twice = 1 - (5 / 6) ** 6, 1 - (5 / 6) ** 6 - 6 * (1 / 6) * (5 / 6) ** 5
    assert share_twice < MIN_DEFINED < share_once
    assert cluster_bootstrap(defined_when(1), cl, n_boot=400, seed=0) == (6.0, 6.0)
    assert cluster_bootstrap(defined_when(2), cl, n_boot=400, seed=0) is None
    assert cluster_bootstrap(lambda w: w.sum(1), ["one"] * 6, n_boot=50, seed=0) is None  # one cluster: no interval
    assert cluster_bootstrap(lambda w: w.sum(1), cl, n_boot=0, seed=0) is None


def test_paired_auroc_resamples_the_clusters_of_its_groups():
    rng = np.random.default_rng(5)
    groups = np.repeat(np.arange(16), 4)
    tasks = groups // 4
    y = np.tile([True, False, True, False], 16)
    s = rng.normal(size=64) + 0.7 * y
    res = paired_auroc(s, y, groups, tasks, n_boot=400, seed=4)

    def within(idx):  # the within-group pairs of the stacked rows, scored by hand
        w = p = 0.0
        for g in np.unique(groups[idx]):
            for _copy in range(int(np.sum(groups[idx] == g) // 4)):
                m = groups == g
                d = s[m & y][:, None] - s[m & ~y][None, :]
                w, p = w + (d > 0).sum() + 0.5 * (d == 0).sum(), p + d.size
        return w / p

    plain = _plain_loop(tasks, 400, 4, within)
    assert (res.lo, res.hi) == pytest.approx(tuple(np.quantile(plain, [0.025, 0.975])))
