"""Entitlement probe sets, token sets, margins and the statistics."""
from __future__ import annotations

import json
import logging
import math
import random

import numpy as np
import pytest
import torch
from lens_data import NOTES_TXT, PLAN_JSON, SALES_CSV

from lens.errors import LensError
from lens.margins import margins, resolve_token_sets
from lens.stats import auroc, bootstrap_auroc, emergence_layer, weighted_auroc
from lhd_train.bench.facts import different_number, extract_facts
from lhd_train.errors import DataFileError
from lhd_train.reading.probes import (
    NOT_ENTITLED,
    REFUTED,
    SUPPORTED,
    build_probe_set,
    read_probes,
    write_probes,
)


def test_fact_extraction():
    csv_facts = extract_facts("sales.csv", SALES_CSV, "csv")
    got = {(f.entity, f.attribute, f.value_text) for f in csv_facts}
    assert ("North", "units", "120") in got and ("East", "margin", "31%") in got and len(got) == 9
    f = next(f for f in csv_facts if f.entity == "South" and f.attribute == "price")
    assert SALES_CSV[f.line_start:f.line_end] == "South,85,4.25,18%"
    js = {(f.entity, f.attribute, f.value_text) for f in extract_facts("plan.json", PLAN_JSON, "json")}
    assert js == {("pilot", "sites", "4"), ("pilot", "budget", "15000"), ("team", "engineers", "3")}
    txt = {(f.attribute, f.value_text) for f in extract_facts("notes.txt", NOTES_TXT, "text")}
    assert txt == {("dock doors", "24"), ("trucks per day", "60")}
    # comment lines before a CSV header are skipped
    assert extract_facts("m.csv", "# exported by hand\nname,score\nA,3\n", "csv")[0].attribute == "score"


def test_different_number_keeps_format():
    rng = random.Random(0)
    for v in ["120", "4.25", "31%", "$1,200.50", "0", "15000"]:
        w = different_number(v, rng)
        assert w != v
        assert w.endswith("%") == v.endswith("%") and w.startswith("$") == v.startswith("$")
        assert ("." in w) == ("." in v)


def test_build_probe_set_minimal_pairs(pack, tmp_path):
    rows = build_probe_set(pack, max_facts_per_task=3, seed=0)
    labels = {r["label"] for r in rows}
    assert labels == {SUPPORTED, REFUTED, NOT_ENTITLED}
    by_pair = {}
    for r in rows:
        by_pair.setdefault(r["pair_id"], []).append(r)
    for pair in by_pair.values():
        kinds = {r["claim_kind"]: r for r in pair}
        s = kinds["stated"]
        assert s["label"] == SUPPORTED
        if "different_number" in kinds:  # same sentence, another number, same record
            r = kinds["different_number"]
            assert r["label"] == REFUTED and r["files"] == s["files"] and r["claim"] != s["claim"]
            assert r["claim"].split(" is ")[0] == s["claim"].split(" is ")[0]
        if "absent_attribute" in kinds:  # same record, an attribute the files never mention
            n = kinds["absent_attribute"]
            assert n["label"] == NOT_ENTITLED and n["files"] == s["files"]
            attr = n["claim"].split(", the ", 1)[1].split(" of ")[0].split(" is ")[0]
            assert attr.lower() not in "".join(f["content"] for f in n["files"]).lower()
        if "evidence_deleted" in kinds:  # same claim, evidence line removed from the record
            d = kinds["evidence_deleted"]
            assert d["label"] == NOT_ENTITLED and d["claim"] == s["claim"] and d["files"] != s["files"]
            files_text = "".join(f["content"] for f in d["files"])
            assert s["fact"]["value"] not in files_text.split(s["fact"]["entity"] or "\0")[-1][:30]
    counts = write_probes(rows, tmp_path / "p.jsonl")
    assert sum(counts.values()) == len(rows)
    assert read_probes(tmp_path / "p.jsonl") == rows
    (tmp_path / "bad.jsonl").write_text('{"schema": "x"}\n')
    with pytest.raises(DataFileError, match="bad.jsonl: line 1: schema"):
        read_probes(tmp_path / "bad.jsonl")


def test_build_probe_set_from_a_real_pack():
    taskpack = pytest.importorskip("lhd_train.bench.taskpack")
    names = taskpack.list_builtin_packs()
    if not names:
        pytest.skip("no built-in pack")
    rows = build_probe_set(taskpack.load_pack(names[0]), pack_name=names[0], max_facts_per_task=4)
    assert {r["label"] for r in rows} == {SUPPORTED, REFUTED, NOT_ENTITLED}
    assert len({r["record_id"] for r in rows}) >= 5


def test_token_sets_single_tokens(llama, caplog):
    _, tok = llama
    with caplog.at_level(logging.INFO, logger="lens.margins"):
        ts = resolve_token_sets(tok)
    assert ts.S and ts.N and ts.R
    for t in ts.union():
        assert len(tok.decode([t]).strip()) > 1
    assert not (set(ts.S) & set(ts.N)) and not (set(ts.S) & set(ts.R)) and not (set(ts.N) & set(ts.R))
    assert "supported" in [f.strip().lower() for f in ts.forms["S"]]
    # user sets: token ids and words
    custom = resolve_token_sets(tok, {"S": ["supported", 7], "N": ["unknown"], "R": []})
    assert 7 in custom.S and not custom.R


def test_token_sets_empty_is_a_clear_error(llama):
    _, tok = llama
    with pytest.raises(LensError, match="--token-sets"):
        resolve_token_sets(tok, {"S": ["xqzjwkvpq"], "N": ["unknown"], "R": []})
    fb = resolve_token_sets(tok, {"S": ["xqzjwkvpq"], "N": ["unknown"], "R": []}, fallback="first-token")
    assert fb.S and fb.mode == "first-token"


def test_margins_formulas():
    z = torch.tensor([[2.0, 0.0, 1.0, -1.0, 3.0]])
    sets = {"S": [0, 1], "N": [2], "R": [3, 4]}
    m = margins(z, sets)
    def lse(*v):
        return math.log(sum(math.exp(x) for x in v))

    S, N, R = lse(2.0, 0.0), 1.0, lse(-1.0, 3.0)
    assert m["m_E"].item() == pytest.approx(S - N)
    assert m["m_R"].item() == pytest.approx(R - max(S, N))
    assert m["m_P"].item() == pytest.approx(S - R)
    assert m["m_E_size"].item() == pytest.approx((S - math.log(2)) - N)
    # invariant to a shift of all logits (the normaliser cancels)
    assert torch.allclose(margins(z + 5, sets)["m_E"], m["m_E"])
    assert torch.isnan(margins(z, {"S": [0], "N": [1], "R": []})["m_R"]).all()


def test_auroc_and_bootstrap():
    assert auroc([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1]) == pytest.approx(0.75)
    assert auroc([1, 1, 1, 1], [0, 1, 0, 1]) == pytest.approx(0.5)  # ties count one half
    rng = np.random.default_rng(0)
    s = rng.normal(size=200)
    y = rng.integers(0, 2, 200).astype(bool)
    from sklearn.metrics import roc_auc_score

    assert auroc(s, y) == pytest.approx(roc_auc_score(y, s))
    w = rng.integers(0, 3, size=(4, 200)).astype(float)
    ref = [roc_auc_score(np.repeat(y, wi.astype(int)), np.repeat(s, wi.astype(int))) for wi in w]
    assert np.allclose(weighted_auroc(s, y, w), ref)
    sep = np.r_[rng.normal(2, 1, 40), rng.normal(0, 1, 40)]
    lab = np.r_[np.ones(40), np.zeros(40)].astype(bool)
    ci = bootstrap_auroc(sep, lab, clusters=np.arange(80) // 4, n_boot=300, seed=1)
    assert ci.lo < ci.auroc < ci.hi and ci.lo > 0.75 and ci.n_clusters == 20
    null = bootstrap_auroc(rng.normal(size=80), lab, clusters=np.arange(80) // 4, n_boot=300)
    assert null.lo < 0.5 < null.hi
    assert math.isnan(bootstrap_auroc([1, 2], [True, True]).auroc)



def test_cluster_bootstrap_interval_matches_a_plain_resampling_of_clusters():
    """The interval is that of resampling whole clusters with replacement: checked against a plain loop
    (another generator, sklearn's AUROC over the concatenated clusters), within Monte Carlo error."""
    from sklearn.metrics import roc_auc_score

    rng = np.random.default_rng(3)
    n_cl = 25
    effect = np.repeat(rng.normal(0, 1.0, n_cl), 4)  # a shared cluster effect: examples are not independent
    y = np.tile([True, True, False, False], n_cl)
    s = effect + 0.8 * y + rng.normal(0, 1, 4 * n_cl)
    cl = np.arange(4 * n_cl) // 4
    got = bootstrap_auroc(s, y, cl, n_boot=2000, seed=0)
    members = [np.flatnonzero(cl == c) for c in range(n_cl)]
    plain = np.random.default_rng(99)
    boots = []
    for _ in range(2000):
        idx = np.concatenate([members[c] for c in plain.integers(0, n_cl, n_cl)])
        boots.append(roc_auc_score(y[idx], s[idx]))
    lo, hi = np.quantile(boots, [0.025, 0.975])
    assert got.auroc == pytest.approx(roc_auc_score(y, s))
    assert got.lo == pytest.approx(lo, abs=0.015) and got.hi == pytest.approx(hi, abs=0.015)

def test_emergence_layer():
    layers = [0, 1, 2, 3, 4, 5]
    au = [0.5, 0.8, 0.6, 0.75, 0.8, 0.9]
    lo = [0.4, 0.6, 0.45, 0.55, 0.6, 0.7]
    assert emergence_layer(layers, au, lo) == 3
    assert emergence_layer(layers, [0.5] * 6, [0.4] * 6) is None
    assert emergence_layer([0, 1], [0.9, 0.9], [0.6, 0.6]) == 0  # fewer layers than the run length


def _many_records(n=8):
    """A pack of `n` tasks with one small CSV each (distinct entities and attributes)."""
    from types import SimpleNamespace

    tasks = []
    for i in range(n):
        content = f"site,visits_{i},orders_{i}\nS{i}a,{10 + i},{3 + i}\nS{i}b,{20 + i},{5 + i}\n"
        tasks.append(SimpleNamespace(index=i + 1, title=f"T{i}",
                                     files=[SimpleNamespace(name=f"f{i}.csv", type="csv", content=content)]))
    return SimpleNamespace(name="many", tasks=tasks)


def test_absent_attributes_never_cross_record_folds():
    """science-4 §3.3: one shared list let a probe recognise an absent attribute in any fold. Each
    attribute now belongs to one record, so no record-grouped split shares one between train and test."""
    from sklearn.model_selection import GroupKFold

    rows = build_probe_set(_many_records(), max_facts_per_task=4, seed=1)
    absent = [r for r in rows if r["claim_kind"] == "absent_attribute"]
    assert len({r["record_id"] for r in absent}) == 8
    for r in absent:
        assert r["absent_attribute"] in r["claim"]
        assert r["absent_attribute"] not in "".join(f["content"] for f in r["files"]).lower()
    groups = [r["record_id"] for r in absent]
    for train, test in GroupKFold(n_splits=4).split(absent, groups=groups):
        seen = {absent[i]["absent_attribute"] for i in train}
        assert not seen & {absent[i]["absent_attribute"] for i in test}
    # and within a record the pool is small (a record reuses its own attributes)
    per_record = {}
    for r in absent:
        per_record.setdefault(r["record_id"], set()).add(r["absent_attribute"])
    assert all(1 <= len(v) <= 2 for v in per_record.values())


def test_probe_rows_are_schema_2_and_schema_1_is_refused(pack, tmp_path):
    rows = build_probe_set(pack, max_facts_per_task=1, seed=0)
    assert {r["schema"] for r in rows} == {"lhd.lens_probe/2"}
    old = dict(rows[0], schema="lhd.lens_probe/1")
    (tmp_path / "old.jsonl").write_text(json.dumps(old) + "\n")
    with pytest.raises(DataFileError, match=r"old\.jsonl: line 1: schema 'lhd.lens_probe/1' is no longer read "
                                            r"\(record-first layout.*lhd lens probe build"):
        read_probes(tmp_path / "old.jsonl")


def test_length_matched_partner_of_evidence_deleted(pack):
    """`stated_other_deleted`: the stated claim, its evidence intact, against the record minus the other
    line closest in length to the evidence line; `evidence_deleted` always has the shorter record."""
    rows = build_probe_set(pack, max_facts_per_task=3, seed=0)
    by_pair = {}
    for r in rows:
        by_pair.setdefault(r["pair_id"], {})[r["claim_kind"]] = r
    matched = [p for p in by_pair.values() if "stated_other_deleted" in p]
    assert matched and all("evidence_deleted" in p for p in matched)
    for p in matched:
        full, other, gone = p["stated"], p["stated_other_deleted"], p["evidence_deleted"]
        assert other["label"] == SUPPORTED and other["claim"] == full["claim"] == gone["claim"]
        name = full["evidence"]["file"]
        before = next(f["content"] for f in full["files"] if f["name"] == name)
        after = next(f["content"] for f in other["files"] if f["name"] == name)
        ev = before[full["evidence"]["start"]:full["evidence"]["end"]]
        assert after[other["evidence"]["start"]:other["evidence"]["end"]] == ev  # the evidence is still there
        removed = [line for line in before.splitlines() if line not in after.splitlines()]
        assert len(removed) == 1 and removed[0] != ev and len(after) == len(before) - len(removed[0]) - 1
        # the closest in length among the other lines (the CSV header is never removed)
        body = [line for line in before.splitlines() if line.strip() and line != ev]
        if name.endswith(".csv"):
            body = body[1:]
        assert abs(len(removed[0]) - len(ev)) == min(abs(len(line) - len(ev)) for line in body)
    # why the review's stated vs evidence_deleted contrast cannot be primary: the deleted record is
    # always the shorter one, so length alone orders every pair inside its record (AUROC 1.0)
    def chars(row):
        return sum(len(f["content"]) for f in row["files"])

    assert all(chars(p["evidence_deleted"]) < chars(p["stated"]) for p in by_pair.values() if "evidence_deleted" in p)
