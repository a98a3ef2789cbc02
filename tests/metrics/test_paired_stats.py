"""Issue 28 item 3, paired comparison: intervals that cover at a few seeds (review science-4 D7),
the minimal detectable difference, the sign-flip permutation test, and the deceptive-only severity
that is undefined without a flag (D11).

Checked against independent computations: seeded simulations of coverage and power, an exact
enumeration of sign patterns, and the per-trial statistics written out."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from scipy import stats
from test_metrics import lab, trial_of

from lhd_train.metrics.paired import paired_effect
from lhd_train.metrics.paired_stats import minimal_detectable_difference, paired_t_interval, sign_flip_p
from lhd_train.metrics.registry import MetricSummary


def test_d7_the_paired_t_interval_covers_where_the_percentile_bootstrap_does_not():
    """The review's simulation: schedule propensity ~ Beta(1.2, 3), 14-42 rounds per seed; the
    adapter scales every propensity by 0.8, so the true mean difference is -0.2 * 1.2 / 4.2."""
    rng = np.random.default_rng(7)
    truth = -0.2 * 1.2 / 4.2
    for n, reps in ((5, 400), (8, 300)):
        hit_t = hit_pct = 0
        for r in range(reps):
            q = rng.beta(1.2, 3, n)
            m = rng.integers(14, 43, n)
            d = rng.binomial(m, 0.8 * q) / m - rng.binomial(m, q) / m
            lo, hi = paired_t_interval(d)
            hit_t += lo <= truth <= hi
            pct = MetricSummary.of(d, resamples=2000, seed=r)  # the report's percentile bootstrap
            lo, hi = pct.ci_low, pct.ci_high
            hit_pct += lo <= truth <= hi
        assert hit_pct / reps < 0.91, (n, hit_pct / reps)  # the review's 0.84 / 0.88
        assert hit_t / reps >= 0.92, (n, hit_t / reps)


def test_minimal_detectable_difference_has_80_percent_power():
    rng = np.random.default_rng(3)
    for n in (5, 10, 20):
        mdd = minimal_detectable_difference(0.110, n)
        x = rng.normal(mdd, 0.110, size=(40_000, n))
        t = x.mean(1) / (x.std(1, ddof=1) / math.sqrt(n))
        power = float(np.mean(np.abs(t) > stats.t.ppf(0.975, n - 1)))
        assert power == pytest.approx(0.80, abs=0.012), (n, power)
    # the review's figures (t quantiles, SD 0.110): 0.18 / 0.11 / 0.073 / 0.050 / 0.035
    for n, review in ((5, 0.18), (10, 0.11), (20, 0.073), (40, 0.050), (80, 0.035)):
        assert minimal_detectable_difference(0.110, n) == pytest.approx(review, abs=0.006)
    assert math.isnan(minimal_detectable_difference(0.0, 10)) and math.isnan(minimal_detectable_difference(0.1, 1))


def _exact_sign_flip_p(d) -> float:
    obs = abs(sum(d))
    return sum(abs(sum(s * x for s, x in zip(signs, d, strict=True))) >= obs - 1e-12
               for signs in itertools.product((1, -1), repeat=len(d))) / 2 ** len(d)


def test_sign_flip_p_exact_and_monte_carlo():
    assert sign_flip_p(np.array([0.3, -0.1, 0.25, 0.4, 0.05, -0.2, 0.15])) == \
        pytest.approx(_exact_sign_flip_p([0.3, -0.1, 0.25, 0.4, 0.05, -0.2, 0.15]))
    rng = np.random.default_rng(5)  # per-seed rate differences in quarters: many ties and zeros
    for n in (2, 3, 6, 11, 16):
        for _ in range(5):
            d = rng.integers(-3, 4, n) / 4
            assert sign_flip_p(d) == pytest.approx(_exact_sign_flip_p(d.tolist()), abs=1e-12), d
    assert sign_flip_p(np.array([0.5])) == 1.0 and math.isnan(sign_flip_p(np.array([])))
    big = np.random.default_rng(1).normal(0.1, 0.3, 18)
    signs = np.array(list(itertools.product((1.0, -1.0), repeat=18)))
    exact18 = float(np.mean(np.abs(signs @ big) >= abs(big.sum()) - 1e-12))
    assert sign_flip_p(big) == pytest.approx(exact18, abs=0.01)  # 20 000 Monte Carlo patterns


def test_d11_a_trial_without_a_flag_has_no_deceptive_severity():
    """The review's example: base trial 2 flags at severity 3 (mean 3.0), adapter trial 0 flags. The
    reference's rule (0.0 without a flag) gives a difference of -3 though no deception got milder."""
    b = trial_of([lab(True, ["FALSIFICATION"], 3)] * 2 + [lab(False)] * 4)
    a = trial_of([lab(False)] * 6)
    assert b["severity_average_deception_only"] - 0 == 3.0 and a["severity_average_deception_only"] == 0.0  # old: -3
    assert b["severity_deceptive_nan"] == 3.0 and math.isnan(a["severity_deceptive_nan"])
    others = [(2.0, 2.5), (3.0, 3.0), (1.5, 1.0), (2.0, 2.0), (4.0, 3.5)]
    eff = paired_effect([b["severity_deceptive_nan"], *(x for x, _ in others)],
                        [a["severity_deceptive_nan"], *(y for _, y in others)])
    assert eff["n_pairs"] == 5 and eff["n_undefined"] == 1
    assert eff["mean_diff"] == pytest.approx(sum(y - x for x, y in others) / 5)
