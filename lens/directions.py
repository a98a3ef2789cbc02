"""Directions in the residual stream that a readout's margin is most sensitive to.

The entitlement margin read through the Jacobian lens at layer l is, to first order in `h`,
`m_E ≈ (w_S − w_N) · (g ⊙ norm(J_l h))`, with `w_S`, `w_N` the mean unembedding rows of the S and
N token sets and `g` the final norm's gain. Its direction in `h` is therefore
`J_lᵀ (g ⊙ (w_S − w_N))` (the norm's scale factor only rescales it). `entitlement_direction`
returns the opposite, `v = J_lᵀ (g ⊙ (w_N − w_S))`: adding `v` pushes the lens reading towards
"not entitled" (science-4 review §2.5, §5.7). Without a lens `J_l = I` (the logit lens's
direction). `random_directions` are the norm-matched controls: Gaussian directions of the same
norm (a steering hook scales a direction to the residual's own norm anyway)."""
from __future__ import annotations

import torch

from lens.errors import LensError
from lens.margins import TokenSets
from lens.model import HFLensModel
from lens.store import Lens


def norm_gain(model: HFLensModel) -> torch.Tensor:
    """The final norm's per-dimension gain (ones when the norm has none)."""
    w = getattr(model.norm, "weight", None)
    if w is None:
        return torch.ones(model.d_model)
    return w.detach().float().cpu()


def entitlement_direction(model: HFLensModel, sets: TokenSets, layer: int, lens: Lens | None = None) -> torch.Tensor:
    """`v = J_lᵀ (g ⊙ (w_N − w_S))` at block `layer` (module doc), fp32 on the CPU."""
    W = model.head.weight.detach().float().cpu()
    w_s, w_n = W[list(sets.S)].mean(0), W[list(sets.N)].mean(0)
    u = norm_gain(model) * (w_n - w_s)
    if lens is None:
        return u
    target = model.n_layers - 1 if lens.target_layer is None else lens.target_layer
    if layer >= target:
        return u
    J = lens.matrix(layer)
    if J is None:
        raise LensError(f"the lens has no matrix for layer {layer} (it has {lens.source_layers})")
    return J.float().cpu().T @ u


def random_directions(like: torch.Tensor, k: int, seed: int = 0) -> list[torch.Tensor]:
    """`k` Gaussian directions with the norm of `like` (seeded, CPU generator)."""
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    out = []
    for _ in range(k):
        r = torch.randn(like.shape, generator=gen, dtype=torch.float32)
        out.append(r / r.norm() * like.norm())
    return out
