"""Readouts: logits at (layer, position) from a residual `h_l`, behind one interface.

- `LogitLens`: `W_U · norm(h_l)` (the Jacobian lens with `J = I`).
- `JacobianLens`: `W_U · norm(J_l h_l)` with the model's real final norm (+ softcap), as the
  reference `apply()`. At and above the target layer `J = I` (so the last block reads out the
  model's own logits).
- `LinearProbe`: logistic regression on `h_l` (z-scored with training statistics), one per
  (layer, position class), whose class logits play the role of vocabulary logits; trained with
  record-grouped splits, and read out of fold (`out_of_fold_logits`) so no example is scored by
  a probe that saw its record.

`logits(layer, h, token_ids=None, position=None)` returns `[..., V]`, or only the columns of
`token_ids` (margins need only the tokens of the entitlement sets; the log-normaliser cancels).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from lens.errors import LensError
from lens.model import LensModel
from lens.store import Lens


@runtime_checkable
class Readout(Protocol):
    name: str

    def logits(self, layer: int, h: torch.Tensor, token_ids: torch.Tensor | None = None,
               position: str | None = None) -> torch.Tensor: ...

    def has_layer(self, layer: int) -> bool:
        """Whether `logits` can read `layer` (a lens fitted on a band of layers lacks the rest)."""
        ...


class LogitLens:
    name = "logit"

    def __init__(self, model: LensModel):
        self.model = model

    def has_layer(self, layer: int) -> bool:
        return True

    def logits(self, layer, h, token_ids=None, position=None):
        with torch.no_grad():
            return self.model.unembed(h, token_ids)


class JacobianLens:
    name = "jacobian"

    def __init__(self, model: LensModel, lens: Lens):
        if lens.d_model != model.d_model:
            raise LensError(f"lens d_model {lens.d_model} != model d_model {model.d_model}")
        target = lens.target_layer
        self.target = model.n_layers - 1 if target is None else target
        self.model = model
        self.lens = lens
        self._J = {layer: J.to(model.device, torch.float32) for layer, J in lens.J.items()}

    def has_layer(self, layer: int) -> bool:
        """Layers with a matrix, plus the target and above (identity); a lens fitted on a band lacks the rest."""
        return layer >= self.target or layer in self._J

    def transport(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """`J_l h` in fp32, cast back to the model dtype; identity at/above the target layer."""
        if layer >= self.target:
            return h
        J = self._J.get(layer)
        if J is None:
            raise LensError(f"the lens has no matrix for layer {layer} (it has {sorted(self._J)})")
        return (h.to(torch.float32) @ J.T).to(h.dtype)

    def logits(self, layer, h, token_ids=None, position=None):
        with torch.no_grad():
            return self.model.unembed(self.transport(layer, h), token_ids)


# ---------------------------------------------------------------------------------------------
# linear probe baseline
# ---------------------------------------------------------------------------------------------


def _make_probe(C: float, seed: int):
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    return make_pipeline(StandardScaler(), LogisticRegression(C=C, max_iter=2000, random_state=seed))


def _class_logits(clf, X: np.ndarray, n_classes: int) -> np.ndarray:
    s = clf.decision_function(X)
    if s.ndim == 1:  # binary: one log-odds; split it symmetrically into two class logits
        s = np.stack([-s / 2, s / 2], axis=1)
    if s.shape[1] != n_classes:
        raise LensError("a probe fold lacked a class; use more records or fewer folds")
    return s


def out_of_fold_logits(
    X: np.ndarray, y: np.ndarray, groups: Sequence[Any], *, n_splits: int = 5, C: float = 1.0, seed: int = 0
) -> np.ndarray:
    """Class logits `[n, K]` for every row from a probe trained on the other record groups.

    Rows of a fold whose training part lacks a class get NaN.
    """
    from sklearn.model_selection import GroupKFold

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
        clf = _make_probe(C, seed).fit(X[train], y[train])
        out[test] = _class_logits(clf, X[test], len(classes))
    return out


class LinearProbe:
    """Probes fitted on all rows, keyed by (layer, position class); for applying to new data."""

    name = "probe"

    def __init__(self, classes: Sequence[Any]):
        self.classes = list(classes)
        self._clf: dict[tuple[int, str | None], Any] = {}

    def fit(self, layer: int, position: str | None, X: np.ndarray, y: np.ndarray, *, C: float = 1.0, seed: int = 0):
        self._clf[(layer, position)] = _make_probe(C, seed).fit(X, y)
        return self

    def has_layer(self, layer: int) -> bool:
        return any(key[0] == layer for key in self._clf)

    def logits(self, layer, h, token_ids=None, position=None):
        clf = self._clf.get((layer, position))
        if clf is None:
            raise LensError(f"no probe fitted for layer {layer}, position {position!r}")
        X = h.detach().float().cpu().numpy().reshape(-1, h.shape[-1])
        z = torch.from_numpy(_class_logits(clf, X, len(self.classes))).reshape(*h.shape[:-1], -1)
        return z if token_ids is None else z[..., token_ids]
