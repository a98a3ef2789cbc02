"""Null lenses: what a Jacobian-lens readout would show if `J_l` carried no information about the model.

`random_transport` keeps each `J_l`'s singular values (its gain and conditioning, so the readout's
sharpness and the echo of large directions are matched) and replaces both singular bases by
random orthogonal matrices. A readout that is as good through this control as through the fitted
lens is not evidence that the lens reads the model (science-4 review §2.5, §3.4). The seed is
recorded in the control's metadata, and one seed gives the same matrices on every machine
(CPU generator, fp64 QR).
"""
from __future__ import annotations

import torch

from lens.record import LensMeta
from lens.store import Lens


def _random_orthogonal(n: int, generator: torch.Generator) -> torch.Tensor:
    """Haar-distributed `n×n` orthogonal matrix (QR of a Gaussian with the sign of R's diagonal fixed)."""
    q, r = torch.linalg.qr(torch.randn(n, n, generator=generator, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r)).where(torch.diagonal(r) != 0, torch.ones(()))[None, :]


def random_transport(lens: Lens, seed: int = 0) -> Lens:
    """A lens whose `J_l = U_rand · diag(σ(J_l)) · V_randᵀ`, with `σ(J_l)` the fitted lens's singular values."""
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    out: dict[int, torch.Tensor] = {}
    for layer in lens.source_layers:
        J = lens.J[layer].to(torch.float64)
        k, d = J.shape
        s = torch.linalg.svdvals(J)
        u = _random_orthogonal(k, gen)[:, : s.shape[0]]
        v = _random_orthogonal(d, gen)[:, : s.shape[0]]
        out[layer] = ((u * s[None, :]) @ v.T).to(torch.float32)
    meta = {key: val for key, val in lens.meta.to_json().items() if key not in ("sha256", "file")}
    meta["control"] = {"kind": "random_transport", "seed": int(seed), "of": lens.meta.sha256}
    return Lens(out, LensMeta.model_validate(meta))
