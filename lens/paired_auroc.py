"""AUROC within matched groups ("paired AUROC"), with a cluster-bootstrap interval.

The entitle reads compare a model's `fabricated` answers with its `supported` answers *about the
same fact*: a positive is only ever ranked against negatives of its own group, so whatever is
constant within a group (the task, the fact, its record, the question's length) cancels. The
statistic is the share of within-group (positive, negative) pairs that the score orders
correctly (ties count half): the Mann–Whitney AUROC restricted to matched pairs, which is the
conditional (stratified) AUROC. Groups without both classes contribute nothing.

The interval resamples clusters (tasks) with replacement, each bringing all of its groups and
their pairs, so pairs sharing a fact or a task are never treated as independent."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from lens.stats import ratio_ci


@dataclass(frozen=True)
class PairedAuroc:
    auroc: float
    lo: float
    hi: float
    n_pairs: int
    n_groups: int
    n_pos: int
    n_neg: int
    n_clusters: int

    def to_json(self) -> dict[str, float | int]:
        return asdict(self)


def _group_counts(scores: np.ndarray, positive: np.ndarray, groups: np.ndarray) -> tuple[dict, dict]:
    """group -> correctly ordered pairs (ties ½), group -> pairs."""
    wins: dict[object, float] = {}
    pairs: dict[object, int] = {}
    for g in np.unique(groups):
        m = groups == g
        pos, neg = scores[m & positive], scores[m & ~positive]
        if len(pos) and len(neg):
            diff = pos[:, None] - neg[None, :]
            wins[g] = float((diff > 0).sum() + 0.5 * (diff == 0).sum())
            pairs[g] = int(diff.size)
    return wins, pairs


def paired_auroc(scores: Sequence[float], positive: Sequence[bool], groups: Sequence[object],
                 clusters: Sequence[object] | None = None, *, n_boot: int = 2000, seed: int = 0,
                 alpha: float = 0.05) -> PairedAuroc:
    """Within-group AUROC of `scores` for `positive` against the rest (module doc); NaN scores are
    dropped. `clusters`: each example's cluster (a task), constant within a group; default: the groups."""
    s = np.asarray(scores, dtype=float)
    y = np.asarray(positive, dtype=bool)
    g = np.asarray([str(v) for v in groups], dtype=object)
    c = np.asarray([str(v) for v in (clusters if clusters is not None else groups)], dtype=object)
    keep = ~np.isnan(s)
    s, y, g, c = s[keep], y[keep], g[keep], c[keep]
    wins, pairs = _group_counts(s, y, g)
    nan = float("nan")
    paired = list(pairs)
    in_pairs = np.isin(g, paired)
    n_pos, n_neg = int((y & in_pairs).sum()), int((~y & in_pairs).sum())
    cluster_of = {grp: c[g == grp][0] for grp in paired}
    n_clusters = len(set(cluster_of.values()))
    total = sum(pairs.values())
    if not total:
        return PairedAuroc(nan, nan, nan, 0, 0, n_pos, n_neg, n_clusters)
    point = sum(wins.values()) / total
    ci = ratio_ci([wins[grp] for grp in paired], [pairs[grp] for grp in paired], [cluster_of[grp] for grp in paired],
                  n_boot=n_boot, seed=seed, alpha=alpha)
    lo, hi = ci or (nan, nan)
    return PairedAuroc(point, lo, hi, total, len(paired), n_pos, n_neg, n_clusters)
