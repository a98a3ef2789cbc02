"""Issue 28 item 3: a rate corrected for the auditor's errors, (p − FPR) / (1 − FNR − FPR), with an
interval that carries the sampling error of p, FNR and FPR (review science-4 §1.5).

Expected values come from the closed form, and the interval's coverage from a seeded simulation of
runs and evaluations whose true prevalence is known."""
from __future__ import annotations

import numpy as np
import pytest

from lhd_train.metrics.correction import ErrorRate, corrected_rate, rogan_gladen


def test_rogan_gladen_closed_form_clipping_and_refusal():
    assert rogan_gladen(0.3, 0.2, 0.1) == pytest.approx((0.3 - 0.1) / (1 - 0.2 - 0.1))
    assert rogan_gladen(0.3, 0.25, 0.0) == pytest.approx(0.3 / 0.75)  # FPR 0: the old 1/(1 − FNR)
    assert rogan_gladen(0.05, 0.2, 0.1) == 0.0  # fewer flags than false positives alone: clipped
    assert rogan_gladen(0.95, 0.3, 0.05) == 1.0
    assert rogan_gladen(0.5, 0.6, 0.4) is None and rogan_gladen(0.5, 0.7, 0.4) is None


def test_corrected_rate_point_and_refusal():
    rates = [0.1, 0.3, 0.2, 0.4, 0.25]
    c = corrected_rate(rates, ErrorRate(6, 20), ErrorRate(2, 40), resamples=2000)
    p = sum(rates) / 5
    assert c.observed == pytest.approx(p) and c.rate == pytest.approx((p - 0.05) / (1 - 0.3 - 0.05))
    assert c.ci_low < c.rate < c.ci_high and not c.fpr_assumed_zero
    up = corrected_rate(rates, ErrorRate(6, 20), None, resamples=2000)
    assert up.fpr_assumed_zero and up.rate == pytest.approx(p / 0.7) and up.rate > c.rate  # FPR 0: an upper bound
    bad = corrected_rate(rates, ErrorRate(12, 20), ErrorRate(20, 40), resamples=2000)
    assert bad.rate is None and "refused" in bad.note and np.isnan(bad.ci_low)


def _coverage(reps: int, n_eff_override: float | None, rng: np.random.Generator) -> float:
    """True mean prevalence 0.2 over trials (Beta(2, 8) per trial), 20 trials of 30 rounds, an
    auditor with FNR 0.3 and FPR 0.05 measured on 60 deceptive and 40 honest independent rows."""
    hits = 0
    for r in range(reps):
        prev = rng.beta(2, 8, 20)
        dec = rng.binomial(30, prev)
        flags = rng.binomial(dec, 0.7) + rng.binomial(30 - dec, 0.05)
        fn, fp = int(rng.binomial(60, 0.3)), int(rng.binomial(40, 0.05))
        c = corrected_rate((flags / 30).tolist(), ErrorRate(fn, 60, n_eff_override),
                           ErrorRate(fp, 40, n_eff_override), resamples=1000, seed=r)
        hits += c.rate is not None and c.ci_low <= 0.2 <= c.ci_high
    return hits / reps


def test_the_interval_covers_because_it_carries_both_error_rates():
    cover = _coverage(300, None, np.random.default_rng(11))
    fixed = _coverage(300, 1e9, np.random.default_rng(11))  # FNR and FPR taken as exact
    assert cover >= 0.91, cover
    assert fixed < cover - 0.05, (fixed, cover)
