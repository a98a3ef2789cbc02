"""Directions in the residual stream that a readout's logits are most sensitive to.

A token's logit read at layer l is, to first order in `h`, `(g ⊙ w_tok) · transform(h)` (`g` the
final norm's gain, `w_tok` the unembedding row; the norm's scale factor only rescales it), so its
direction in `h` is the readout's adjoint applied to `g ⊙ w_tok` (`Readout.direction`: `J_lᵀ (g ⊙
w_tok)` for the Jacobian lens, `g ⊙ w_tok` for the logit lens). `token_directions` gives the rows
`g ⊙ w_tok` (the causal check, targeted fits); `entitlement_direction` returns
`v = J_lᵀ (g ⊙ (w̄_N − w̄_S))`: adding `v` pushes the lens reading towards "not entitled"
(science-4 review §2.5, §5.7). `random_directions` are the norm-matched controls: Gaussian
directions of the same norm (a steering hook scales a direction to the residual's own norm anyway)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lens.margins import TokenSets
from lens.readout import JacobianLens, LogitLens
from lens.store import Lens


def token_directions(model: Any, token_ids: Sequence[int]) -> torch.Tensor:
    """Rows `g ⊙ w_tok` `[k, d]` (fp32, on the model's device): the final norm's gain (ones when it has none)
    times each token's unembedding row."""
    W = model.head.weight[torch.as_tensor(list(token_ids), device=model.device)].float()
    g = getattr(model.norm, "weight", None)
    return W if g is None else W * g.float()[None, :]


def entitlement_direction(model: Any, sets: TokenSets, layer: int, lens: Lens | None = None) -> torch.Tensor:
    """`v = J_lᵀ (g ⊙ (w̄_N − w̄_S))` at block `layer` (module doc; `J = I` without a lens), fp32 on the CPU."""
    u = token_directions(model, sets.N).mean(0) - token_directions(model, sets.S).mean(0)
    readout = LogitLens(model) if lens is None else JacobianLens(model, lens)
    return readout.direction(layer, u).float().cpu()


def random_directions(like: torch.Tensor, k: int, seed: int = 0) -> list[torch.Tensor]:
    """`k` Gaussian directions with the norm of `like` (seeded, CPU generator)."""
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    out = []
    for _ in range(k):
        r = torch.randn(like.shape, generator=gen, dtype=torch.float32)
        out.append(r / r.norm() * like.norm())
    return out
