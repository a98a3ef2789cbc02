"""The linear-probe baseline: logistic regression on `h_l` (z-scored with training statistics), one
per (layer, position class), whose class logits play the role of vocabulary logits.

It is no readout of the residual stream (`lens.readout`): nothing maps `h` into the unembedding's
space, and a probe reads only examples it was not trained on. So it is trained with record-grouped
splits and read out of fold (`out_of_fold_logits`): no example is scored by a probe that saw its
record. Its rows in a margins table carry the readout name `PROBE`.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from lens.errors import LensError

PROBE = "probe"


def out_of_fold_logits(
    X: np.ndarray, y: np.ndarray, groups: Sequence[Any], *, n_splits: int = 5, C: float = 1.0, seed: int = 0
) -> np.ndarray:
    """Class logits `[n, K]` for every row from a probe trained on the other record groups (a binary
    probe's one log-odds split symmetrically into two class logits). Rows of a fold whose training
    part lacks a class get NaN."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import GroupKFold
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    y = np.asarray(y)
    classes = np.unique(y)
    group_ids = np.asarray(groups)
    n_groups = len(np.unique(group_ids))
    if n_groups < 2:
        raise LensError("the probe baseline needs at least 2 records (grouped splits)")
    out = np.full((len(y), len(classes)), np.nan)
    for train, test in GroupKFold(n_splits=min(n_splits, n_groups)).split(X, y, group_ids):
        if len(np.unique(y[train])) != len(classes):
            continue
        clf = make_pipeline(StandardScaler(), LogisticRegression(C=C, max_iter=2000, random_state=seed))
        s = clf.fit(X[train], y[train]).decision_function(X[test])
        out[test] = np.stack([-s / 2, s / 2], axis=1) if s.ndim == 1 else s
    return out
