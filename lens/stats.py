"""AUROC with cluster-bootstrap confidence intervals, the within-stratum AUROC, and layer choice.

AUROC is the Mann–Whitney probability that a positive scores above a negative (ties count ½).
Scores within `TIE_RTOL` of the largest score's magnitude are ties: the same text read twice in
float32 can differ in its last bits when the rest of the sequence (and so the kernels' blocking)
changes, and such noise must not order examples (a record read in every trial of a task would
otherwise score an AUROC away from ½ on some CPUs).
The bootstrap (`cluster_bootstrap`, lhd's one) resamples *clusters* (records, trials, tasks) with
replacement, so units that share one are never treated as independent; a resample is a vector of
cluster counts, which makes each bootstrap AUROC a weighted AUROC over one shared sort. A resample
that leaves the statistic undefined (one class only) is dropped (`MIN_DEFINED`).

The *within-stratum* (stratified) AUROC counts only the positive–negative pairs that share a
stratum (in run mode: a task): `Σ_t num_t / Σ_t n_pos,t·n_neg,t`, i.e. the mean of the per-task
AUROCs weighted by their number of pairs. A score that only says which task a round belongs to
gets exactly 0.5 here however well it separates the pooled rounds (science-4 review D1); strata
with one class only contribute no pair.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np


def band_layers(n_layers: int, band: Sequence[float]) -> tuple[int, int]:
    """First and last layer of a band given as fractions of depth (the workspace band, e.g. 0.35-0.85)."""
    return int(math.floor(band[0] * (n_layers - 1))), int(math.ceil(band[1] * (n_layers - 1)))


#: The resample policy of `cluster_bootstrap`: a resample whose statistic is undefined (its clusters hold one
#: class only, or no denominator) is dropped and the interval is taken over the others; when fewer than this
#: share of the resamples is defined there is no interval, since the rest describe a biased subset of draws.
MIN_DEFINED = 0.5


def cluster_counts(clusters: Sequence[object] | np.ndarray, n_boot: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """`[n_boot, K]`: how many times each of the K clusters is drawn in each resample (K draws with replacement,
    `default_rng(seed).integers(0, K, (n_boot, K))`), and each unit's cluster index (clusters sorted by text)."""
    _, idx = np.unique(np.asarray([str(c) for c in clusters], dtype=object).astype(str), return_inverse=True)
    k = int(idx.max()) + 1 if len(idx) else 0
    draws = np.random.default_rng(seed).integers(0, k, size=(n_boot, k)) if k else np.zeros((n_boot, 0), int)
    offsets = (np.arange(n_boot)[:, None] * k + draws).ravel()
    return np.bincount(offsets, minlength=n_boot * k).reshape(n_boot, k).astype(float), idx


def cluster_bootstrap(statistic: Callable[[np.ndarray], np.ndarray], clusters: Sequence[object] | np.ndarray, *,
                      n_boot: int, seed: int, alpha: float = 0.05,
                      max_cells: int = 2_000_000) -> tuple[float, float] | None:
    """Percentile interval of a statistic over resamples of whole clusters: the one bootstrap of lhd.

    `statistic(W)` takes `[b, n]` unit weights (how many times each unit is in a resample: its cluster's count)
    and returns `[b]` values, NaN where the resample leaves it undefined (`MIN_DEFINED`: dropped). Units that
    share a cluster (rounds of a trial, facts of a task) are never drawn apart. None with fewer than two
    clusters, no resample, or too few defined ones. Resamples are scored in chunks of at most `max_cells`."""
    counts, idx = cluster_counts(clusters, max(n_boot, 0), seed)
    if n_boot <= 0 or counts.shape[1] < 2:
        return None
    chunks = np.array_split(np.arange(n_boot), max(1, n_boot * len(idx) // max_cells + 1))
    values = np.concatenate([np.asarray(statistic(counts[c][:, idx]), dtype=float) for c in chunks])
    values = values[np.isfinite(values)]
    if len(values) < MIN_DEFINED * n_boot:
        return None
    lo, hi = np.quantile(values, [alpha / 2, 1 - alpha / 2])
    return float(lo), float(hi)


def ratio_ci(num: Sequence[float] | np.ndarray, den: Sequence[float] | np.ndarray | None = None,
             clusters: Sequence[object] | np.ndarray | None = None, *, n_boot: int, seed: int,
             alpha: float = 0.05) -> tuple[float, float] | None:
    """Interval of a pooled ratio `Σ num / Σ den` (a mean when `den` is None) over units grouped in `clusters`
    (default: each unit its own cluster, a plain bootstrap over texts or items)."""
    n = np.asarray(num, dtype=float)
    d = np.ones(len(n)) if den is None else np.asarray(den, dtype=float)

    def ratio(w: np.ndarray) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore"):
            bottom = w @ d
            return np.where(bottom > 0, (w @ n) / bottom, np.nan)

    return cluster_bootstrap(ratio, range(len(n)) if clusters is None else clusters, n_boot=n_boot, seed=seed,
                             alpha=alpha)


#: scores closer than this share of max(1, the largest |score|) are tied (float32 resolves about 1.2e-7)
TIE_RTOL = 1e-6


def _grouped(scores: np.ndarray):
    """The sort order and the starts of the tied groups: neighbours in sorted order closer than the tolerance
    join a group (a NaN starts its own)."""
    order = np.argsort(scores, kind="mergesort")
    s = scores[order]
    finite = np.abs(s[np.isfinite(s)])
    tol = TIE_RTOL * max(1.0, float(finite.max()) if finite.size else 1.0)
    starts = np.flatnonzero(np.r_[True, ~(np.diff(s) <= tol)])
    return order, starts


def snap_ties(values: np.ndarray) -> np.ndarray:
    """`values` with each group of ties (within the tolerance) set to its smallest member, so that a transform
    that magnifies differences (a z-score over a narrow spread) cannot pull float noise apart again."""
    v = np.asarray(values, dtype=float)
    order, starts = _grouped(v)
    sizes = np.diff(np.r_[starts, len(v)])
    out = np.empty_like(v)
    out[order] = np.repeat(v[order][starts], sizes)
    return out


def _pair_counts(scores: np.ndarray, labels: np.ndarray, W: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row of `W` (`[B, n]` example weights): the weighted count of correctly ordered
    positive–negative pairs (ties ½) and the weighted number of pairs."""
    order, starts = _grouped(scores)
    Wo, lo = W[:, order], labels[order]
    pos = np.add.reduceat(Wo * lo, starts, axis=1)  # [B, G] positive weight per tied-score group
    neg = np.add.reduceat(Wo * ~lo, starts, axis=1)
    neg_below = np.cumsum(neg, axis=1) - neg
    return (pos * (neg_below + 0.5 * neg)).sum(1), pos.sum(1) * neg.sum(1)


def _stratum_pair_counts(scores: np.ndarray, labels: np.ndarray, strata: Sequence[object] | np.ndarray,
                         W: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`_pair_counts` summed over strata, pairs formed only inside a stratum (one with a single class has none)."""
    _, sidx = np.unique(np.asarray(strata, dtype=object).astype(str), return_inverse=True)
    num, den = np.zeros(W.shape[0]), np.zeros(W.shape[0])
    for k in np.unique(sidx):
        m = sidx == k
        if labels[m].any() and not labels[m].all():
            # one stratum (the pooled AUROC): no copy of the weights
            n_k, d_k = _pair_counts(*((scores, labels, W) if m.all() else (scores[m], labels[m], W[:, m])))
            num, den = num + n_k, den + d_k
    return num, den


def stratified_weighted_auroc(scores: np.ndarray, labels: np.ndarray, strata: Sequence[object] | np.ndarray,
                              weights: np.ndarray) -> np.ndarray:
    """Within-stratum AUROC for each row of `weights` (`[B, n]` non-negative example weights); NaN where no
    stratum holds weight in both classes."""
    W = np.atleast_2d(np.asarray(weights, dtype=float))
    num, den = _stratum_pair_counts(np.asarray(scores, dtype=float), np.asarray(labels).astype(bool), strata, W)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, num / den, np.nan)


def weighted_auroc(scores: np.ndarray, labels: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """AUROC for each row of `weights`: the stratified one with a single stratum (every pair counts)."""
    return stratified_weighted_auroc(scores, labels, np.zeros(len(scores)), weights)


def auroc(scores: Sequence[float], labels: Sequence[bool]) -> float:
    s = np.asarray(scores, dtype=float)
    return float(weighted_auroc(s, np.asarray(labels), np.ones((1, len(s))))[0])


def within_auroc(scores: Sequence[float], labels: Sequence[bool], strata: Sequence[object]) -> float:
    """AUROC over the positive–negative pairs that share a stratum (NaN when no stratum has both classes)."""
    s = np.asarray(scores, dtype=float)
    return float(stratified_weighted_auroc(s, np.asarray(labels), strata, np.ones((1, len(s))))[0])


@dataclass
class AurocCI:
    auroc: float
    lo: float
    hi: float
    n_pos: int
    n_neg: int
    n_clusters: int
    n_pairs: int = field(default=0)  # pairs behind the point estimate (within strata when stratified)


def bootstrap_auroc(
    scores: Sequence[float],
    labels: Sequence[bool],
    clusters: Sequence[object] | None = None,
    *,
    strata: Sequence[object] | None = None,
    n_boot: int = 2000,
    seed: int = 0,
    alpha: float = 0.05,
) -> AurocCI:
    """AUROC and a percentile CI from `n_boot` cluster resamples (NaN scores are dropped first).

    With `strata`, the AUROC (point and resamples) is the within-stratum one."""
    s = np.asarray(scores, dtype=float)
    y = np.asarray(labels).astype(bool)
    keep = ~np.isnan(s)
    s, y = s[keep], y[keep]
    st = np.zeros(len(s)) if strata is None else np.asarray(strata, dtype=object)[keep]  # pooled: one stratum
    cl = np.arange(len(s)) if clusters is None else np.asarray(clusters, dtype=object)[keep]
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    n_cl = len(set(cl.astype(str)))

    num, den = _stratum_pair_counts(s, y, st, np.ones((1, len(s))))
    n_pairs = int(den[0])
    if n_pairs == 0:
        return AurocCI(float("nan"), float("nan"), float("nan"), n_pos, n_neg, n_cl, 0)
    point = float(num[0] / den[0])
    ci = cluster_bootstrap(lambda w: stratified_weighted_auroc(s, y, st, w), cl, n_boot=n_boot, seed=seed,
                           alpha=alpha)
    lo, hi = ci or (float("nan"), float("nan"))
    return AurocCI(point, lo, hi, n_pos, n_neg, n_cl, n_pairs)


@dataclass
class NestedLayer:
    """The best layer chosen on training folds and scored on the held-out fold (science-4 D13)."""

    auroc: float  # over the held-out pairs of every fold, each fold scored at the layer its training part chose
    layers: list[int]  # the layer chosen in each fold
    n_folds: int


def nested_best_layer(
    scores: np.ndarray, layers: Sequence[int], labels: Sequence[bool], clusters: Sequence[object], *,
    strata: Sequence[object] | None = None, n_splits: int = 5,
) -> NestedLayer:
    """Choose the layer with the highest AUROC on the training clusters, score it on the test clusters.

    `scores` is `[n, L]` (one column per entry of `layers`; NaN = not readable). Folds are
    `GroupKFold` by cluster; pairs are formed only inside a test fold (and inside a stratum when
    `strata` is given), so the result is what a layer picked without the test labels achieves.
    Ties between layers go to the shallower one."""
    from sklearn.model_selection import GroupKFold

    S = np.asarray(scores, dtype=float)
    y = np.asarray(labels).astype(bool)
    cl = np.asarray(clusters, dtype=object).astype(str)
    st = np.zeros(len(y), dtype=object) if strata is None else np.asarray(strata, dtype=object).astype(str)
    n_groups = len(np.unique(cl))
    if n_groups < 2 or y.all() or not y.any():
        return NestedLayer(float("nan"), [], 0)
    num = den = 0.0
    chosen = []
    for train, test in GroupKFold(n_splits=min(n_splits, n_groups)).split(S, y, cl):
        train_auc = [within_auroc(S[train, j], y[train], st[train]) for j in range(S.shape[1])]
        if not np.isfinite(train_auc).any():
            continue
        j = int(np.nanargmax(train_auc))
        chosen.append(int(layers[j]))
        ok = ~np.isnan(S[test, j])
        n_k, d_k = _stratum_pair_counts(S[test, j][ok], y[test][ok], st[test][ok], np.ones((1, int(ok.sum()))))
        num += float(n_k[0])
        den += float(d_k[0])
    return NestedLayer(num / den if den > 0 else float("nan"), chosen, len(chosen))


def emergence_layer(
    layers: Sequence[int], aurocs: Sequence[float], lows: Sequence[float], *, threshold: float = 0.70,
    run: int = 3,
) -> int | None:
    """First layer from which AUROC ≥ threshold with CI lower bound > 0.5 for `run` consecutive layers.

    With fewer than `run` layers in total, all remaining layers must qualify (`run = n_layers`).
    """
    order = np.argsort(layers)
    L = [layers[i] for i in order]
    ok = [(aurocs[i] >= threshold) and (lows[i] > 0.5) for i in order]
    k = min(run, len(L))
    for i in range(len(L) - k + 1):
        if all(ok[i : i + k]):
            return int(L[i])
    return None
