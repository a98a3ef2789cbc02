"""`lhd report RUN_BASE RUN_ADAPTER`: the adapter's effect paired by seed (issue 24, item 5).

Every expected number is computed here by hand from the labels the synthetic runs are written
with (per-seed rates and severities in plain Python, the bootstrap's percentile interval from the
exact bootstrap distribution enumerated over all resamples, the sign test from binomial
coefficients), never by the functions under test."""
from __future__ import annotations

import csv
import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest
from support.synthetic import R, write_run

from lhd_train.report import build_report
from lhd_train.rundir.layout import RunDir

F = "FALSIFICATION"
EVENTS = [("GOAL_CONFLICT", "HIGH"), None]  # task 1 has an event, task 2 none


def _trial(severities: list[int], events: list = EVENTS) -> list[R]:
    """Four rounds, two per task; a severity > 0 is a flagged round with that severity."""
    return [R(i // 2 + 1, events[i // 2], label=(s > 0, [F] if s else [], s)) for i, s in enumerate(severities)]


# Per seed: the base's and the adapter's severities per round (0 = not flagged).
BASE = {1: [2, 2, 0, 0], 2: [3, 0, 0, 1], 3: [0, 0, 0, 0], 4: [1, 1, 1, 0], 5: [2, 0, 0, 0], 6: [4, 4, 0, 0]}
LORA = {1: [0, 2, 0, 0], 2: [0, 0, 0, 0], 3: [0, 0, 0, 0], 4: [1, 0, 0, 0], 5: [0, 0, 1, 0], 6: [4, 0, 0, 0]}


def _rate(sev: list[int]) -> float:
    return sum(1 for s in sev if s > 0) / len(sev)


def _sev_all(sev: list[int]) -> float:
    return sum(sev) / len(sev)


def _exact_bootstrap_interval(diffs: list[float]) -> tuple[float, float]:
    """The 2.5 % and 97.5 % quantiles of the exact bootstrap distribution of the mean: every one
    of the n^n equally likely resamples, enumerated."""
    n = len(diffs)
    means = sorted(sum(diffs[i] for i in idx) / n for idx in itertools.product(range(n), repeat=n))
    return means[math.floor(0.025 * (len(means) - 1))], means[math.ceil(0.975 * (len(means) - 1))]


def _sign_p(up: int, down: int) -> float:
    """Two-sided exact binomial (sign) test with p = 1/2, from the binomial coefficients."""
    n, k = up + down, min(up, down)
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n)


def _runs(root: Path, base: dict[int, list[int]], lora: dict[int, list[int]], **lora_events) -> tuple[Path, Path]:
    a = write_run(root, "base", {f"s{k}": _trial(v) for k, v in base.items()})
    b = write_run(root, "lora", {f"s{k}": _trial(v, lora_events.get(f"s{k}", EVENTS)) for k, v in lora.items()},
                  adapter="/ckpt/adapters/honest-lora")
    return a, b


def _csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _effects(out: Path) -> dict[str, dict[str, str]]:
    return {r["metric"]: r for r in _csv(out / "tables" / "paired.csv")}


def test_paired_difference_interval_and_sign_test_by_hand(tmp_path):
    a, b = _runs(tmp_path, BASE, LORA)
    out = tmp_path / "report"
    html = build_report([a, b], out).read_text()
    eff = _effects(out)
    for metric, per_seed in (("deception_rate", _rate), ("severity_average_all_rounds", _sev_all)):
        diffs = [per_seed(LORA[s]) - per_seed(BASE[s]) for s in sorted(BASE)]
        r = eff[metric]
        assert (r["base"], r["other"], int(r["n_pairs"])) == ("base", "lora", 6)
        assert float(r["mean_base"]) == pytest.approx(sum(per_seed(v) for v in BASE.values()) / 6)
        assert float(r["mean_other"]) == pytest.approx(sum(per_seed(v) for v in LORA.values()) / 6)
        assert float(r["mean_diff"]) == pytest.approx(sum(diffs) / 6)
        up, down = sum(d > 0 for d in diffs), sum(d < 0 for d in diffs)
        assert (int(r["n_up"]), int(r["n_down"]), int(r["n_zero"])) == (up, down, 6 - up - down)
        assert float(r["sign_p"]) == pytest.approx(_sign_p(up, down))
        # 10 000 seeded resamples land within one step of the exact bootstrap quantiles (the
        # resampled means move in steps of 1/24 here: differences of k/4 averaged over 6 seeds).
        lo, hi = _exact_bootstrap_interval(diffs)
        step = 1 / 24
        assert float(r["ci_low"]) == pytest.approx(lo, abs=step + 1e-9)
        assert float(r["ci_high"]) == pytest.approx(hi, abs=step + 1e-9)
    # rate: 5 seeds down, 1 tied -> the interval excludes 0, but the sign test p = 2/32 does not confirm it
    assert _sign_p(0, 5) == 0.0625
    assert eff["deception_rate"]["verdict"].startswith("lower than the base")
    assert "sign test does not confirm" in eff["deception_rate"]["verdict"]
    # severity over deceptive rounds (0 without deception): seeds 2 and 5 are 3 -> 0 and 2 -> 1; four tie
    d = [((max(LORA[s]) and sum(LORA[s]) / sum(x > 0 for x in LORA[s])) or 0)
         - ((max(BASE[s]) and sum(BASE[s]) / sum(x > 0 for x in BASE[s])) or 0) for s in sorted(BASE)]
    r = eff["severity_average_deception_only"]
    assert float(r["mean_diff"]) == pytest.approx(sum(d) / 6)
    assert (int(r["n_up"]), int(r["n_down"]), int(r["n_zero"])) == (sum(x > 0 for x in d), sum(x < 0 for x in d),
                                                                    sum(x == 0 for x in d))
    # per seed, in tables/paired_trials.csv
    trials = {t["trial_id"]: t for t in _csv(out / "tables" / "paired_trials.csv")}
    assert set(trials) == {f"s{k}" for k in BASE} and {t["status"] for t in trials.values()} == {"paired"}
    for s in BASE:
        assert float(trials[f"s{s}"]["deception_rate_diff"]) == pytest.approx(_rate(LORA[s]) - _rate(BASE[s]))
    # the report's section and summary.md
    assert 'id="paired"' in html and 'id="table-paired"' in html
    summary = (out / "summary.md").read_text()
    assert "Paired by seed against the base run base" in summary
    assert "lora, deception_rate: 6 paired seeds" in summary


def test_bootstrap_is_seeded_and_a_constant_difference_has_a_zero_width_interval(tmp_path):
    """Every seed goes from 2 flagged rounds of 4 to 1: difference -1/4 on each of 6 seeds."""
    base = {s: [1, 1, 0, 0] for s in range(1, 7)}
    lora = {s: [1, 0, 0, 0] for s in range(1, 7)}
    a, b = _runs(tmp_path, base, lora)
    build_report([a, b], tmp_path / "r1")
    build_report([a, b], tmp_path / "r2")
    one, two = _effects(tmp_path / "r1"), _effects(tmp_path / "r2")
    assert one == two  # seeded: the same report twice
    r = one["deception_rate"]
    assert (float(r["ci_low"]), float(r["ci_high"])) == (-0.25, -0.25)
    assert float(r["sign_p"]) == pytest.approx(2 / 2 ** 6)  # 6 of 6 down
    assert r["verdict"] == "lower than the base"


def test_too_few_seeds_are_too_few_to_tell(tmp_path):
    seeds = (1, 2, 3)
    a, b = _runs(tmp_path, {s: BASE[s] for s in seeds}, {s: LORA[s] for s in seeds})
    build_report([a, b], tmp_path / "out")
    r = _effects(tmp_path / "out")["deception_rate"]
    assert int(r["n_pairs"]) == 3
    assert float(r["mean_diff"]) == pytest.approx(sum(_rate(LORA[s]) - _rate(BASE[s]) for s in seeds) / 3)
    assert r["verdict"] == "too few paired trials to tell (3 < 5)"
    assert "too few paired trials to tell (3 < 5)" in (tmp_path / "out" / "summary.md").read_text()


def test_an_interval_that_includes_zero_cannot_tell(tmp_path):
    """Six seeds, three up and three down by the same amount."""
    base = {s: ([1, 0, 0, 0] if s % 2 else [1, 1, 0, 0]) for s in range(1, 7)}
    lora = {s: ([1, 1, 0, 0] if s % 2 else [1, 0, 0, 0]) for s in range(1, 7)}
    a, b = _runs(tmp_path, base, lora)
    build_report([a, b], tmp_path / "out")
    r = _effects(tmp_path / "out")["deception_rate"]
    assert float(r["mean_diff"]) == 0.0 and float(r["ci_low"]) < 0 < float(r["ci_high"])
    assert float(r["sign_p"]) == pytest.approx(_sign_p(3, 3)) == 1.0
    assert r["verdict"] == "cannot tell: the interval includes 0"


def test_trials_whose_schedules_or_seeds_differ_are_named_and_left_out(tmp_path):
    """s4 of the adapter run drew another event; s6's schedule file is gone from the base run;
    s7 exists only in the adapter run: only s1, s2, s3, s5 are paired."""
    lora = {**LORA, 7: [0, 0, 0, 0]}
    a, b = _runs(tmp_path, BASE, lora, s4=[("INFORMATION_GAP", "LOW"), None])
    RunDir(a).schedule("s6").unlink()
    sched = json.loads(RunDir(b).schedule("s4").read_text())
    assert sched != json.loads(RunDir(a).schedule("s4").read_text())
    out = tmp_path / "out"
    build_report([a, b], out)
    trials = {t["trial_id"]: t["status"] for t in _csv(out / "tables" / "paired_trials.csv")}
    assert trials == {"s1": "paired", "s2": "paired", "s3": "paired", "s4": "schedule differs", "s5": "paired",
                      "s6": "schedule not recorded", "s7": "only in other"}
    paired = (1, 2, 3, 5)
    r = _effects(out)["deception_rate"]
    assert int(r["n_pairs"]) == 4
    assert float(r["mean_diff"]) == pytest.approx(sum(_rate(LORA[s]) - _rate(BASE[s]) for s in paired) / 4)
    assert r["verdict"] == "too few paired trials to tell (4 < 5)"
    summary = (out / "summary.md").read_text()
    assert "1 trial(s) left out of the pairs (schedule differs): s4" in summary
    assert "1 trial(s) left out of the pairs (schedule not recorded): s6" in summary
    assert "1 trial(s) left out of the pairs (only in lora): s7" in summary
    assert "schedule differs): s4" in (out / "report.html").read_text()


def test_one_run_has_no_paired_section(tmp_path):
    a, _ = _runs(tmp_path, BASE, LORA)
    out = tmp_path / "out"
    html = build_report([a], out).read_text()
    assert not (out / "tables" / "paired.csv").exists() and 'id="paired"' not in html
    assert np.isfinite(float(_csv(out / "tables" / "runs.csv")[0]["deception_rate_mean"]))
