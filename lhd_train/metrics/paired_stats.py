"""The statistics of a paired comparison over seeds (docs/metrics.md, "Paired comparison").

With a handful of seeds the percentile bootstrap of a mean is too narrow: it covered 0.84 at 5
seeds and 0.88 at 8 in the review's simulation (science-4 D7), where the paired-t interval covers
0.95. So the interval to read is the paired t; beside it a BCa bootstrap (scipy), an exact
sign-flip permutation test (scipy; every one of the 2^n sign patterns up to `EXACT_MAX` pairs,
else a seeded Monte Carlo), the sign test as a robustness line, and the minimal detectable difference:
the smallest true mean difference a two-sided 0.05 paired t-test finds with 80 % power at this
many seeds and this spread (noncentral t), so "cannot tell" comes with how large an effect the
run could have told."""
from __future__ import annotations

import math
import warnings

import numpy as np
from scipy import optimize, stats

EXACT_MAX = 16  # up to 2^16 = 65 536 sign patterns: enumerate them all; beyond, as many random ones
POWER, ALPHA = 0.80, 0.05


def paired_t_interval(d: np.ndarray, level: float = 0.95) -> tuple[float, float]:
    """mean ± t_{n−1} · sd / √n; NaN for fewer than 2 pairs, zero width when every difference is equal."""
    n = len(d)
    if n < 2:
        return float("nan"), float("nan")
    m, sd = float(d.mean()), float(d.std(ddof=1))
    half = float(stats.t.ppf(0.5 + level / 2, n - 1)) * sd / math.sqrt(n)
    return m - half, m + half


def bca_interval(d: np.ndarray, level: float = 0.95, resamples: int = 10_000, seed: int = 0) -> tuple[float, float]:
    """scipy's bias-corrected and accelerated bootstrap interval of the mean (seeded); NaN for fewer
    than 3 pairs, zero width when every difference is equal."""
    n = len(d)
    if n < 3:
        return float("nan"), float("nan")
    if float(np.ptp(d)) == 0.0:
        return float(d[0]), float(d[0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # scipy warns when few distinct resampled means make BCa unstable
        res = stats.bootstrap((d,), np.mean, confidence_level=level, n_resamples=resamples, method="BCa",
                              random_state=np.random.default_rng(seed))
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def sign_flip_p(d: np.ndarray, seed: int = 0) -> float:
    """Two-sided p of the mean difference under random signs (the paired permutation test, scipy's
    `permutation_test`): the share of sign patterns whose |mean| is at least the observed one. Exact
    for n ≤ EXACT_MAX (every pattern), else 2^EXACT_MAX seeded random ones; NaN for n = 0."""
    if len(d) < 2:
        return 1.0 if len(d) else float("nan")  # one difference: both of its signs are as extreme
    return float(stats.permutation_test((d,), np.mean, permutation_type="samples", n_resamples=2 ** EXACT_MAX,
                                        vectorized=True, random_state=np.random.default_rng(seed)).pvalue)


def sign_test(d: np.ndarray) -> tuple[int, int, int, float]:
    """(up, down, zero, two-sided p): an exact binomial test with p = 1/2 on the non-zero
    differences (ties carry no sign and are left out); p is NaN without a non-zero difference."""
    up, down = int((d > 0).sum()), int((d < 0).sum())
    zero = int(len(d) - up - down)
    p = float(stats.binomtest(up, up + down, 0.5).pvalue) if up + down else float("nan")
    return up, down, zero, p


def t_power(delta: float, sd: float, n: int, alpha: float = ALPHA) -> float:
    """Power of the two-sided one-sample t-test of mean 0 when the true mean is `delta`."""
    df, nc = n - 1, delta * math.sqrt(n) / sd
    crit = float(stats.t.ppf(1 - alpha / 2, df))
    upper, lower = float(stats.nct.sf(crit, df, nc)), float(stats.nct.cdf(-crit, df, nc))
    return upper + (0.0 if math.isnan(lower) else lower)  # scipy's far lower tail can be NaN where it is ~0


def minimal_detectable_difference(sd: float, n: int, power: float = POWER, alpha: float = ALPHA) -> float:
    """The true mean difference a two-sided `alpha` paired t-test detects with `power` at n pairs
    whose differences have standard deviation sd; NaN for n < 2 or sd 0 (no spread measured)."""
    if n < 2 or not sd > 0 or math.isnan(sd):
        return float("nan")
    hi = sd
    while t_power(hi, sd, n, alpha) < power:
        hi *= 2
    return float(optimize.brentq(lambda x: t_power(x, sd, n, alpha) - power, 0.0, hi, xtol=1e-10 * sd))
