"""AUROC with cluster-bootstrap confidence intervals, and the layer of emergence.

AUROC is the Mann–Whitney probability that a positive scores above a negative (ties count ½).
The bootstrap resamples *clusters* (records, or trials) with replacement, so examples that share a
record are never treated as independent; a resample is a vector of cluster counts, which makes
each bootstrap AUROC a weighted AUROC over one shared sort.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


def _grouped(scores: np.ndarray):
    order = np.argsort(scores, kind="mergesort")
    s = scores[order]
    starts = np.flatnonzero(np.r_[True, s[1:] != s[:-1]])
    return order, starts


def weighted_auroc(scores: np.ndarray, labels: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """AUROC for each row of `weights` (`[B, n]` non-negative example weights); NaN where a class has no weight."""
    scores = np.asarray(scores, dtype=float)
    labels = np.asarray(labels).astype(bool)
    W = np.atleast_2d(np.asarray(weights, dtype=float))
    order, starts = _grouped(scores)
    Wo, lo = W[:, order], labels[order]
    pos = np.add.reduceat(Wo * lo, starts, axis=1)  # [B, G] positive weight per tied-score group
    neg = np.add.reduceat(Wo * ~lo, starts, axis=1)
    neg_below = np.cumsum(neg, axis=1) - neg
    num = (pos * (neg_below + 0.5 * neg)).sum(1)
    den = pos.sum(1) * neg.sum(1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, num / den, np.nan)


def auroc(scores: Sequence[float], labels: Sequence[bool]) -> float:
    s = np.asarray(scores, dtype=float)
    return float(weighted_auroc(s, np.asarray(labels), np.ones((1, len(s))))[0])


@dataclass
class AurocCI:
    auroc: float
    lo: float
    hi: float
    n_pos: int
    n_neg: int
    n_clusters: int


def bootstrap_auroc(
    scores: Sequence[float],
    labels: Sequence[bool],
    clusters: Sequence[object] | None = None,
    *,
    n_boot: int = 2000,
    seed: int = 0,
    alpha: float = 0.05,
) -> AurocCI:
    """AUROC and a percentile CI from `n_boot` cluster resamples (NaN scores are dropped first)."""
    s = np.asarray(scores, dtype=float)
    y = np.asarray(labels).astype(bool)
    keep = ~np.isnan(s)
    s, y = s[keep], y[keep]
    cl = np.arange(len(s)) if clusters is None else np.asarray(clusters, dtype=object)[keep]
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    _, cidx = np.unique(cl.astype(str), return_inverse=True)
    n_cl = int(cidx.max()) + 1 if len(cidx) else 0
    if n_pos == 0 or n_neg == 0:
        return AurocCI(float("nan"), float("nan"), float("nan"), n_pos, n_neg, n_cl)
    point = float(weighted_auroc(s, y, np.ones((1, len(s))))[0])
    if n_boot <= 0 or n_cl < 2:
        return AurocCI(point, float("nan"), float("nan"), n_pos, n_neg, n_cl)
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, n_cl, size=(n_boot, n_cl))
    counts = np.zeros((n_boot, n_cl))
    np.add.at(counts, (np.repeat(np.arange(n_boot), n_cl), draws.ravel()), 1)
    boots = []
    for chunk in np.array_split(np.arange(n_boot), max(1, n_boot * len(s) // 2_000_000 + 1)):
        boots.append(weighted_auroc(s, y, counts[chunk][:, cidx]))
    b = np.concatenate(boots)
    b = b[~np.isnan(b)]
    if len(b) == 0:
        return AurocCI(point, float("nan"), float("nan"), n_pos, n_neg, n_cl)
    lo, hi = np.quantile(b, [alpha / 2, 1 - alpha / 2])
    return AurocCI(point, float(lo), float(hi), n_pos, n_neg, n_cl)


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
