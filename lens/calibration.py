"""Calibration-free views of a readout's next-token KL (science-4 review §2.3, §2.4 item 3).

A readout can have a lower KL only because it is less over-confident, so `lens.fidelity` reports KL
beside a uniform predictor (`log V − H(p)`), the model's marginal next-token distribution (fitted on
the calibration half, scored on the other), top-k agreement (no temperature changes it) and KL after
a per-layer temperature fitted on the calibration half. docs/lens.md, "Next-token KL on held-out text"."""
from __future__ import annotations

import math

import numpy as np
import torch
from scipy.optimize import minimize_scalar

LOG_T_BOUNDS = (math.log(0.02), math.log(50.0))


def uniform_kl(logp: torch.Tensor) -> torch.Tensor:
    """`log V − H(p)` per row of log-probabilities `[n, V]`."""
    return math.log(logp.shape[-1]) + (logp.exp() * logp).sum(-1)


def kl_rows(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """`KL(p ‖ q)` per row, nats."""
    return (logp.exp() * (logp - logq)).sum(-1)


def tempered_kl(logp: torch.Tensor, z: torch.Tensor, temperature: float) -> torch.Tensor:
    """`KL(p ‖ softmax(z / T))` per row."""
    return kl_rows(logp, torch.log_softmax(z.float() / temperature, dim=-1))


def fit_temperature(logp: torch.Tensor, z: torch.Tensor) -> float:
    """The `T` minimising the mean `KL(p ‖ softmax(z / T))` over the rows (bounded search over `log T`).

    The objective is `mean(Σ p log p − Σ p z / T + logsumexp(z / T))`, convex in `1/T`."""
    z = z.float()
    p = logp.exp()
    pz = (p * z).sum(-1).double()
    ent = (p * logp).sum(-1).double()

    def objective(log_t: float) -> float:
        t = math.exp(log_t)
        return float((ent - pz / t + torch.logsumexp(z / t, dim=-1).double()).mean())

    res = minimize_scalar(objective, bounds=LOG_T_BOUNDS, method="bounded", options={"xatol": 1e-3})
    return float(math.exp(res.x))


def even_subsample(n: int, m: int) -> np.ndarray:
    """`min(n, m)` indices spread evenly over `range(n)`."""
    if n <= m:
        return np.arange(n)
    return np.unique(np.linspace(0, n - 1, m).round().astype(int))
