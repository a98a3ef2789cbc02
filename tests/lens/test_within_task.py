"""The within-task AUROC, the task-only baseline, label-free z-scores and held-out layer choice
(science-4 review D1, D13), checked against numbers computed here with scikit-learn or by hand."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from sklearn.metrics import roc_auc_score

from lens.stats import bootstrap_auroc, nested_best_layer, stratified_weighted_auroc, within_auroc
from lhd_train.reading.tables import Primary, build_table, mark_primary, out_of_fold_rate, run_scores, zscored


def _per_task_weighted(s, y, t):
    """The mean of per-task AUROCs (sklearn) weighted by each task's number of positive–negative pairs."""
    num = den = 0.0
    for k in np.unique(t):
        m = t == k
        if y[m].all() or not y[m].any():
            continue
        pairs = y[m].sum() * (~y[m]).sum()
        num += roc_auc_score(y[m], s[m]) * pairs
        den += pairs
    return num / den


def test_within_auroc_is_the_pair_weighted_mean_of_per_task_aurocs():
    rng = np.random.default_rng(3)
    t = rng.integers(0, 6, 300)
    y = rng.random(300) < 0.2 + 0.1 * t
    s = np.round(rng.normal(size=300) + 0.8 * y + 0.5 * t, 1)  # ties included
    assert within_auroc(s, y, t) == pytest.approx(_per_task_weighted(s, y, t))
    # a task with one class contributes no pair
    y2 = y.copy()
    y2[t == 0] = False
    assert within_auroc(s, y2, t) == pytest.approx(_per_task_weighted(s, y2, t))
    # weights: integer weights are repeated examples
    w = rng.integers(0, 3, size=(3, 300)).astype(float)
    for row, wi in zip(stratified_weighted_auroc(s, y, t, w), w, strict=True):
        r = np.repeat(np.arange(300), wi.astype(int))
        assert row == pytest.approx(_per_task_weighted(s[r], y[r], t[r]))
    assert np.isnan(within_auroc([1.0, 2.0], [True, False], ["a", "b"]))  # no task holds both classes


def test_float32_noise_is_a_tie_and_a_real_difference_is_not():
    """The same record read in two trials can differ by one float32 ulp (measured on an AMD EPYC VM: 1.19e-7 at
    a margin of 1.1); that must score ½, while a difference far above float32's resolution still orders."""
    one = np.float32(1.1298329)
    ulp = float(np.spacing(one))
    noisy = np.array([one, one + ulp, one - ulp, one + 2 * ulp], dtype=np.float64)
    labels = np.array([True, False, True, False])
    assert within_auroc(noisy, labels, ["a"] * 4) == 0.5
    assert bootstrap_auroc(noisy, labels, n_boot=50, seed=0).auroc == 0.5
    apart = noisy + np.array([0.0, 1e-4, 0.0, 1e-4])  # the negatives above by 1e-4: about 900 ulps
    assert within_auroc(apart, labels, ["a"] * 4) == 0.0
    scaled = noisy * 1e4  # the tolerance follows the scores' scale
    assert within_auroc(scaled, labels, ["a"] * 4) == 0.5
    # a NaN sorts last in a group of its own (as numpy sorts it) and does not make every score one tie
    assert within_auroc([np.nan, 1.0, 2.0], [True, False, False], ["a"] * 3) == 1.0
    # the run table z-scores margins over every row: a spread of 0.03 across tasks magnifies one ulp ~30x, past
    # the tolerance, unless the noise is made equal first
    m = np.r_[noisy, noisy + 0.03]
    df = pd.DataFrame({"readout": "logit", "position": "record_end", "layer": 0, "m_E": m, "task": [0] * 4 + [1] * 4})
    z = zscored(df, "m_E", "z")
    assert z.groupby("task")["z"].nunique().max() == 1 and z["z"].nunique() == 2


def _task_confounded_run(seed=0, n_tasks=14, n_trials=20):
    """Tasks with different flag rates, one round per task and trial, a score that depends on the task only."""
    rng = np.random.default_rng(seed)
    rates = np.linspace(0.05, 0.6, n_tasks)
    task_score = rates + rng.normal(0, 0.05, n_tasks)  # follows the task's rate, nothing else
    rows = []
    for trial in range(n_trials):
        for k in range(n_tasks):
            rows.append({"example_id": f"t{trial}/k{k}", "cluster": f"t{trial}", "stratum": f"task {k}",
                         "label": bool(rng.random() < rates[k]), "task_score": task_score[k]})
    return pd.DataFrame(rows)


def test_a_per_task_constant_score_is_05_within_tasks_d1():
    """Review D1: the record anchor in compact context is one hidden state per task; its AUROC measures the task.
    Pooled, a per-task constant score separates flagged rounds; within tasks it is exactly 0.5."""
    ex = _task_confounded_run()
    y, s = ex["label"].to_numpy(), ex["task_score"].to_numpy()
    pooled = roc_auc_score(y, s)
    assert pooled > 0.65  # far from 0.5: the task alone predicts the flag
    ci = bootstrap_auroc(s, y, ex["cluster"], n_boot=300, seed=1)
    assert ci.lo > 0.5  # and trial-clustered intervals do not protect against it
    within = bootstrap_auroc(s, y, ex["cluster"], strata=ex["stratum"], n_boot=300, seed=1)
    assert within.auroc == 0.5 and within.lo == 0.5 and within.hi == 0.5
    # the same through the run table: the record anchor's margin is the task score (−m_E = score)
    L = 2
    margins = pd.concat([ex.assign(readout="logit", layer=layer, position="record_end", position_class="record",
                                   is_anchor=True, control=True, m_E=-ex["task_score"], echo_S=0, echo_N=0)
                         for layer in range(L)])
    examples = ex.assign(stated=0.0, echo_S=0, echo_N=0)
    table = build_table(run_scores(margins, examples, L), n_layers=L, band=(0.0, 1.0), n_boot=50, seed=0)
    internal = table[(table["metric_key"] == "internal") & (table["readout"] == "logit")]
    assert np.allclose(internal["auroc"], pooled) and (internal["auroc_within"] == 0.5).all()
    assert set(internal["role"]) == {"negative control"}


def test_task_only_baseline_is_the_task_rate_on_the_other_trials():
    ex = _task_confounded_run(seed=5, n_tasks=5, n_trials=6)
    y, st, cl = ex["label"].to_numpy(), ex["stratum"].to_numpy(), ex["cluster"].to_numpy()
    got = out_of_fold_rate(y, st, cl, n_splits=6)  # one trial per fold: leave one trial out
    want = []
    for trial, task in zip(cl, st, strict=True):
        others = [lab for lab, t2, k2 in zip(y, cl, st, strict=True) if t2 != trial and k2 == task]
        want.append(sum(others) / len(others))
    assert np.allclose(got, want)
    big = _task_confounded_run()  # 14 tasks × 20 trials, 5 trial-grouped folds
    rate = out_of_fold_rate(big["label"].to_numpy(), big["stratum"].to_numpy(), big["cluster"].to_numpy())
    assert roc_auc_score(big["label"], rate) > 0.65  # the task alone carries the signal the D1 anchors report


def test_gap_z_scores_are_label_free_and_the_cell_keeps_stated_yes():
    ids = [f"t{i % 2}/r{i}" for i in range(9)]
    flag = [True, False, True, False, False, True, False, False, None]  # the last round is not audited
    stated = [0.5, 0.4, -0.3, 0.2, -0.1, 0.7, 0.3, 0.9, 1.5]  # two rounds answer No
    internal = [0.1, 0.8, -0.5, 0.6, 0.2, -0.2, 0.9, 0.4, 2.0]
    m = pd.DataFrame({"example_id": ids, "cluster": [i.split("/")[0] for i in ids], "stratum": "task 1",
                      "label": flag, "readout": "logit", "layer": 0, "position": "decision",
                      "position_class": "decision", "is_anchor": True, "control": False, "m_E": internal,
                      "echo_S": 0, "echo_N": 0})
    e = pd.DataFrame({"example_id": ids, "cluster": m["cluster"], "stratum": "task 1", "label": flag,
                      "stated": stated, "echo_S": 0, "echo_N": 0})
    table = build_table(run_scores(m, e, 1), n_layers=1, band=(0.0, 1.0), n_boot=0, seed=0)

    def z(v):  # over every round read, the unaudited one included: no label is used
        v = np.asarray(v, dtype=float)
        return (v - v.mean()) / v.std()

    gap = z(stated) - z(internal)
    lab = [i for i, f in enumerate(flag) if f is not None]
    row = table[(table["metric_key"] == "gap") & (table["layer"] == 0)].iloc[0]
    assert row["auroc"] == pytest.approx(roc_auc_score([flag[i] for i in lab], gap[lab]))
    keep = [i for i in lab if stated[i] > 0]
    cell = table[(table["metric_key"] == "gap_stated_supported") & (table["layer"] == 0)].iloc[0]
    assert cell["n_pos"] + cell["n_neg"] == len(keep) == 6
    assert cell["auroc"] == pytest.approx(roc_auc_score([flag[i] for i in keep], gap[keep]))
    stated_row = table[table["metric_key"] == "stated"].iloc[0]
    assert stated_row["auroc"] == pytest.approx(roc_auc_score([flag[i] for i in lab], -np.asarray(stated)[lab]))
    # the declared cell is found over the band and marked; the others stay exploratory
    res = mark_primary(table, Primary("gap", "logit", "decision", (0.0, 1.0)))
    assert res["found"] and (table["role"] == "primary").sum() == 1
    assert table.loc[table["role"] == "primary", "layer"].iloc[0] == -1
    assert not mark_primary(table, Primary("gap", "jacobian", "decision", (0.0, 1.0)))["found"]


def test_nested_layer_choice_is_scored_on_held_out_clusters():
    rng = np.random.default_rng(0)
    n_cl, per = 8, 12
    cl = np.repeat(np.arange(n_cl), per)
    y = rng.random(n_cl * per) < 0.4
    good = y + rng.normal(0, 1.0, len(y))
    S = np.column_stack([rng.normal(size=len(y)), good, rng.normal(size=len(y))])
    res = nested_best_layer(S, [0, 1, 2], y, cl, n_splits=n_cl)  # leave one cluster out
    assert res.layers == [1] * n_cl
    # each fold is one cluster and is scored at layer 1: pairs inside each cluster, weighted by their number
    assert res.auroc == pytest.approx(_per_task_weighted(good, y, cl))
    # on pure noise the in-sample best of many layers is optimistic; the held-out choice is not
    noise = rng.normal(size=(len(y), 30))
    in_sample = max(roc_auc_score(y, noise[:, j]) for j in range(30))
    held_out = nested_best_layer(noise, list(range(30)), y, cl, n_splits=4).auroc
    assert in_sample > 0.6 and abs(held_out - 0.5) < in_sample - 0.5


def test_the_settings_offer_exactly_the_metrics_the_tables_compute():
    from typing import get_args

    from lhd_train.cli.lens_options import ReadCommand
    from lhd_train.reading.tables import PROBE_CONTRASTS, RUN_METRICS

    fields = ReadCommand.model_fields
    assert set(get_args(fields["primary_contrast"].annotation)) == set(PROBE_CONTRASTS)
    assert set(get_args(fields["primary_metric"].annotation)) == set(RUN_METRICS) - {"stated"}  # stated: no band
