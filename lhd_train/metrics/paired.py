"""An adapter's effect, paired by seed: `lhd report RUN_BASE RUN_ADAPTER` (docs/metrics.md,
"Paired comparison").

Two runs of the same seeds and event schedules differ only in the performer, so per-seed
differences of a trial metric remove the spread between seeds. Each trial keeps its run's headline
auditor, or both runs are scored by one held-out auditor (`report.adapter_checks`). Interval: the
paired t, with a BCa bootstrap beside it; test: exact sign-flip; plus the sign test and the minimal
detectable difference (`paired_stats`). A pair with a NaN value is dropped and counted (review D11)."""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from lhd_train.metrics.load import RunData
from lhd_train.metrics.paired_stats import (
    bca_interval,
    minimal_detectable_difference,
    paired_t_interval,
    sign_flip_p,
    sign_test,
)
from lhd_train.metrics.registry import PairedValue, TrialMetric, paired_metrics

MIN_PAIRS = 5  # fewer paired seeds than this: too few to tell, whatever the interval says
PAIRED = "paired"
BOOT_SEED = 0


@dataclass
class PairedComparison:
    """One run against the base run: per-metric effects, per-trial pairing, and notes."""

    base: str
    other: str
    effects: pd.DataFrame
    trials: pd.DataFrame
    notes: list[str] = field(default_factory=list)


def _seeds(run: RunData) -> dict[str, Any]:
    return dict(zip(run.trials["trial_id"], run.trials["seed"], strict=True)) if len(run.trials) else {}


def pair_trials(base: RunData, other: RunData) -> pd.DataFrame:
    """Every trial id of either run with its pairing status: `paired` (same trial id, same seed,
    identical saved schedule), else why not: `only in base`, `only in other`, `seed differs`,
    `schedule differs`, `schedule not recorded`. Only `paired` trials enter the differences."""
    sb, so = _seeds(base), _seeds(other)
    recs = []
    for tid in [*sb, *(t for t in so if t not in sb)]:
        if tid not in so:
            status = "only in base"
        elif tid not in sb:
            status = "only in other"
        elif sb[tid] != so[tid]:
            status = "seed differs"
        else:
            a, b = base.schedules.get(tid), other.schedules.get(tid)
            status = "schedule not recorded" if a is None or b is None else PAIRED if a == b else "schedule differs"
        recs.append({"trial_id": tid, "seed": sb.get(tid, so.get(tid)), "status": status})
    return pd.DataFrame(recs, columns=["trial_id", "seed", "status"])


def verdict(n: int, lo: float, hi: float, perm_p: float = float("nan"), mdd: float = float("nan"),
            min_pairs: int = MIN_PAIRS, alpha: float = 0.05) -> str:
    """What the paired-t interval lets one say, in words. When it includes 0, the verdict names the
    minimal detectable difference (an effect smaller than that could not have been told apart);
    when it excludes 0 but the sign-flip permutation test does not reach `alpha`, it says so."""
    if n == 0:
        return "no paired trials"
    if n < min_pairs:
        return f"too few paired trials to tell ({n} < {min_pairs})"
    if math.isnan(lo) or math.isnan(hi) or lo <= 0.0 <= hi:
        tail = f" (at {n} seeds only a difference of ±{mdd:.3g} or more is found with 80 % power)" \
            if not math.isnan(mdd) else ""
        return "cannot tell: the interval includes 0" + tail
    out = "lower than the base" if hi < 0 else "higher than the base"
    if not perm_p < alpha:
        out += f" by the interval; the sign-flip permutation test does not confirm it (p ≥ {alpha:g})"
    return out


def paired_effect(base_values: list[float], other_values: list[float], level: float = 0.95,
                  seed: int = BOOT_SEED, min_pairs: int = MIN_PAIRS) -> dict[str, Any]:
    """The mean per-seed difference other − base over the pairs where both values exist (the
    others are dropped and counted in `n_undefined`), its paired-t interval (`ci_low`, `ci_high`),
    the BCa bootstrap interval, the sign-flip permutation p, the sign test, the SD of the
    differences, the minimal detectable difference at 80 % power and the verdict."""
    a, b = np.asarray(base_values, float), np.asarray(other_values, float)
    ok = ~(np.isnan(a) | np.isnan(b))
    undefined = int((~ok).sum())
    a, b = a[ok], b[ok]
    d = b - a
    n = int(len(d))
    lo, hi = paired_t_interval(d, level)
    bca_lo, bca_hi = bca_interval(d, level, seed=seed)
    up, down, zero, p = sign_test(d)
    perm = sign_flip_p(d, seed)
    nan = float("nan")
    sd = float(d.std(ddof=1)) if n > 1 else nan
    mdd = minimal_detectable_difference(sd, n)
    return {"n_pairs": n, "n_undefined": undefined, "mean_base": float(a.mean()) if n else nan,
            "mean_other": float(b.mean()) if n else nan, "mean_diff": float(d.mean()) if n else nan,
            "sd_diff": sd, "ci_low": lo, "ci_high": hi, "bca_low": bca_lo, "bca_high": bca_hi,
            "perm_p": perm, "n_up": up, "n_down": down, "n_zero": zero, "sign_p": p, "mdd": mdd,
            "verdict": verdict(n, lo, hi, perm, mdd, min_pairs)}


def _value(df: pd.DataFrame, metric: str, trial_id: str) -> float:
    """A trial's metric, NaN when the trial is absent."""
    return float(df.at[trial_id, metric]) if trial_id in df.index else float("nan")


def _name(tids: list[str]) -> str:
    return ", ".join(tids[:8]) + (" ..." if len(tids) > 8 else "")


def _undefined_causes(paired: pd.DataFrame, metric: str, vals: dict[str, pd.DataFrame],
                      runs: dict[str, RunData]) -> dict[str, list[str]]:
    """Why each paired trial's `metric` is undefined, in words, with the trials: labels missing (the
    auditor never labelled the trial's rounds: audit it to fill them), no valid label (its labels
    failed), or no flagged round (a severity over deceptive rounds). Missing is named as missing so
    that an auditor that was not run on a trial never reads as one that could not label it."""
    out: dict[str, list[str]] = {}
    for r in paired.to_dict("records"):
        for key, side in (("base", r["base"]), ("other", r["other"])):
            v = r[metric]
            if not math.isnan(getattr(v, key)):
                continue
            row = vals[side].loc[r["trial_id"]] if r["trial_id"] in vals[side].index else None
            aid = runs[side].auditor_id
            if row is not None and row["total_rounds"] == 0 and row["missing_rounds"] > 0 \
                    and row["failed_rounds"] == 0:
                why = f"labels missing in {side} (not audited by {aid})"
            elif row is None or row["total_rounds"] == 0:
                why = f"no valid label from {aid} in {side}"
            else:
                why = f"no round flagged by {aid} in {side}"
            out.setdefault(why, []).append(r["trial_id"])
    return out


def compare_paired(base: RunData, other: RunData, per_trial: pd.DataFrame,
                   metrics: Sequence[TrialMetric] | None = None, min_pairs: int = MIN_PAIRS) -> PairedComparison:
    """`other` against `base` on their paired trials, for each of `metrics` (default: the registry's
    `paired_metrics`); `per_trial` is `core.per_trial_table` of both (column `run` = RunData.key).
    Trials that cannot be paired are named in the notes."""
    metrics = paired_metrics() if metrics is None else metrics
    pairing = pair_trials(base, other)
    vals = {key: per_trial[per_trial["run"] == key].set_index("trial_id") for key in (base.key, other.key)}
    rows = []
    for r in pairing.to_dict("records"):
        rec = dict(r)
        for m in metrics:
            vb, vo = _value(vals[base.key], m.name, r["trial_id"]), _value(vals[other.key], m.name, r["trial_id"])
            rec[m.name] = PairedValue(vb, vo, vo - vb if r["status"] == PAIRED else float("nan"))
        rows.append(rec)
    trials = pd.DataFrame(rows)
    trials.insert(0, "other", other.key)
    trials.insert(0, "base", base.key)
    paired = trials[trials["status"] == PAIRED]
    scored_by = base.auditor_id if base.auditor_id == other.auditor_id else f"{base.auditor_id} / {other.auditor_id}"
    effects = pd.DataFrame([{"base": base.key, "other": other.key, "auditor": scored_by, "metric": m.name,
                             **paired_effect([v.base for v in paired[m.name]], [v.other for v in paired[m.name]],
                                             min_pairs=min_pairs)} for m in metrics])
    runs = {base.key: base, other.key: other}
    notes = [f"{m.name}: {n} paired seed(s) dropped, undefined on one side or both ("
             + "; ".join(f"{why}: {_name(tids)}" for why, tids in _undefined_causes(paired, m.name, vals, runs).items())
             + ")"
             for m, n in zip(metrics, effects["n_undefined"], strict=True) if n]
    for status in ("schedule differs", "schedule not recorded", "seed differs", "only in base", "only in other"):
        tids = trials.loc[trials["status"] == status, "trial_id"].tolist()
        if tids:
            where = {"only in base": f"only in {base.key}", "only in other": f"only in {other.key}"}.get(status, status)
            notes.append(f"{len(tids)} trial(s) left out of the pairs ({where}): {_name(tids)}")
    if base.auditor_id != other.auditor_id:
        notes.append(f"the two runs are scored by different headline auditors ({base.auditor_id} and "
                     f"{other.auditor_id}): a difference may come from the auditors")
    sha_b, sha_o = base.manifest.pack_sha256, other.manifest.pack_sha256
    if sha_b and sha_o and sha_b != sha_o:
        notes.append("the two runs recorded different task packs (pack_sha256)")
    return PairedComparison(base.key, other.key, effects, trials, notes)


def compare_to_base(runs: list[RunData], per_trial: pd.DataFrame) -> list[PairedComparison]:
    """Every run after the first against the first (the base): `lhd report BASE ADAPTER [...]`."""
    return [compare_paired(runs[0], r, per_trial) for r in runs[1:]]
