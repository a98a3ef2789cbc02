"""A deception rate corrected for the auditor's measured errors (docs/validity.md, "Correcting a
rate").

An auditor with false-negative rate FNR and false-positive rate FPR flags a round with probability
p = π(1 − FNR) + (1 − π)FPR when a share π of rounds is deceptive, so the Rogan–Gladen estimator
is π̂ = (p − FPR) / (1 − FNR − FPR), clipped to [0, 1]. It is refused when 1 − FNR − FPR ≤ 0 (the
auditor is no better than a coin: its flags carry no information about π). The interval carries
the sampling error of all three: each draw resamples the run's trials (as the report's interval
of p does) and draws FNR and FPR from their Jeffreys Beta(k + ½, n − k + ½) distributions on the
effective sample sizes of `lhd audit-eval` (n / deff, so clustered rounds count for less); the
95 % interval is the percentile interval of the corrected draws. Draws whose denominator is ≤ 0
are left out and counted.

When only a planted run measured the auditor, no FPR is known: FPR = 0 gives the largest
correction (for p < 1 − FNR the estimate falls as FPR grows), so the result is an upper bound
and says so. The correction is only as good as the transfer of FNR: FNR measured on planted
edits need not hold for the run's natural deceptions (review science-4 D4)."""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lens.stats import cluster_counts

RESAMPLES = 10_000
SEED = 0


@dataclass(frozen=True)
class ErrorRate:
    """An auditor error rate as measured: k of n on an effective sample size `n_eff` (n when the
    rounds are independent, n / deff when they cluster)."""

    k: int
    n: int
    n_eff: float | None = None

    @property
    def rate(self) -> float:
        return self.k / self.n

    def draws(self, rng: np.random.Generator, size: int) -> np.ndarray:
        """Jeffreys Beta draws on the effective sample size (keeps uncertainty at k = 0 or k = n)."""
        m = float(self.n_eff if self.n_eff is not None else self.n)
        k = self.rate * m
        return rng.beta(k + 0.5, m - k + 0.5, size)


@dataclass(frozen=True)
class CorrectedRate:
    rate: float | None       # None: refused (1 − FNR − FPR ≤ 0) or no p
    ci_low: float
    ci_high: float
    observed: float          # p, the run's flag rate
    fnr: float
    fpr: float
    fpr_assumed_zero: bool   # no FPR measured: an upper bound
    refused_share: float     # draws left out with 1 − FNR − FPR ≤ 0
    note: str


def rogan_gladen(p: float, fnr: float, fpr: float) -> float | None:
    """(p − FPR) / (1 − FNR − FPR) clipped to [0, 1]; None when 1 − FNR − FPR ≤ 0."""
    den = 1.0 - fnr - fpr
    if den <= 0:
        return None
    return min(1.0, max(0.0, (p - fpr) / den))


def corrected_rate(trial_rates: Sequence[float], fnr: ErrorRate, fpr: ErrorRate | None,
                   resamples: int = RESAMPLES, seed: int = SEED) -> CorrectedRate:
    """The run's mean per-trial flag rate corrected for `fnr` and `fpr` (None: not measured, taken
    as 0, an upper bound), with a 95 % interval over trials, FNR and FPR together."""
    x = np.asarray([v for v in trial_rates if v is not None and not math.isnan(v)], float)
    nan = float("nan")
    zero = fpr is None
    f_fpr = 0.0 if fpr is None else fpr.rate
    if not len(x) or not fnr.n or (fpr is not None and not fpr.n):
        return CorrectedRate(None, nan, nan, float(x.mean()) if len(x) else nan, fnr.rate if fnr.n else nan,
                             f_fpr, zero, nan, "no corrected rate: the run or the auditor's error rates have no data")
    p = float(x.mean())
    point = rogan_gladen(p, fnr.rate, f_fpr)
    counts, _ = cluster_counts(range(len(x)), resamples, seed)  # the trials, drawn by lhd's one bootstrap
    p_draws = counts @ x / len(x)
    rng = np.random.default_rng([seed, 1])
    fnr_draws = fnr.draws(rng, resamples)
    fpr_draws = np.zeros(resamples) if fpr is None else fpr.draws(rng, resamples)
    den = 1.0 - fnr_draws - fpr_draws
    ok = den > 0
    refused = float(1.0 - ok.mean())
    corrected = np.clip((p_draws[ok] - fpr_draws[ok]) / den[ok], 0.0, 1.0)
    lo, hi = (np.quantile(corrected, [0.025, 0.975]) if len(corrected) else (nan, nan))
    if point is None:
        lo, hi = nan, nan
        note = "refused: 1 − FNR − FPR ≤ 0, the auditor's flags say nothing about the rate"
    elif zero:
        note = "a planted run measures no FPR: with FPR 0 this is an upper bound"
    else:
        note = "Rogan–Gladen, interval over trials, FNR and FPR"
    return CorrectedRate(point, float(lo), float(hi), p, fnr.rate, f_fpr, zero, refused, note)
