"""`lhd entitle run` end to end with a scripted performer that fabricates in known cells: every
count, rate, bound, interval and paired test of entitle_summary.json is recounted here from the
trial files on disk, with the script's own expected labels and independent computations (scipy,
plain loops)."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from entitle_disk import answers_on_disk
from entitle_script import SampledScripted, expected_label, script
from scipy.stats import binomtest

from lhd_train.bench.taskpack import load_pack
from lhd_train.entitle.items import build_items
from lhd_train.entitle.run import run_entitle
from lhd_train.entitle.settings import EntitleRunCommand
from lhd_train.errors import InputError

PACK = "lhd_startup_consulting"


def settings(out: Path, **kw) -> EntitleRunCommand:
    return EntitleRunCommand(model_or_config="scripted-model", out=out, pack=PACK, facts=kw.pop("facts", 8),
                             progress=False, **kw)


def rows_of(out: Path) -> list[dict]:
    rows = answers_on_disk(out)
    assert len({r["id"] for r in rows}) == len(rows)  # each answer stored once
    return rows


def boot_ci(per_fact: dict[str, tuple[float, float]], task_of: dict[str, int], resamples=2000, seed=0):
    """Tasks resampled with replacement, written as a plain loop (the code under test vectorises it)."""
    tasks = sorted({str(t) for t in task_of.values()})
    by_task = {t: [f for f in per_fact if str(task_of[f]) == t] for t in tasks}
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, len(tasks), size=(resamples, len(tasks)))
    vals = []
    for row in draws:
        num = sum(per_fact[f][0] for i in row for f in by_task[tasks[i]])
        den = sum(per_fact[f][1] for i in row for f in by_task[tasks[i]])
        if den:
            vals.append(num / den)
    return list(np.quantile(vals, [0.025, 0.975]))


def test_every_metric_recounts_from_disk(tmp_path):
    pack = load_pack(PACK)
    items, _ = build_items(pack, 8, seed=0)
    reply, kinds = script(pack, items)
    out = tmp_path / "e"
    res = run_entitle(settings(out, samples=2), backend=SampledScripted(reply))
    rows = rows_of(out)
    summary = json.loads((out / "entitle_summary.json").read_text())
    assert res.summary == summary
    n_control = sum(i.control is not None for i in items)
    assert len(rows) == (7 * len(items) + n_control) * 3  # greedy + 2 samples per cell
    assert summary["n_planned"] == len(rows) and summary["missing"] == 0 and summary["missing_note"] is None
    n_tasks = len({(r["pack"], r["task"]) for r in rows})  # power counts tasks, not answers
    assert summary["power"]["n_tasks"] == summary["n_tasks"] == n_tasks
    assert summary["power"]["min_p"] == pytest.approx(2 / 2 ** n_tasks)
    # every row's label is the script's
    for r in rows:
        assert r["label"] == expected_label(kinds[(r["fact"], r["files"], r["pressure"])], r["files"]), r
        for key in ("fact", "files", "pressure", "label", "answer", "asserted"):
            assert key in r
    # per-cell multinomials: every label's count and share
    for c in summary["conditions"]:
        mine = Counter(r["label"] for r in rows if (r["files"], r["pressure"]) == (c["files"], c["pressure"]))
        assert {k: v for k, v in c["counts"].items() if v} == dict(mine)
        assert c["n"] == sum(mine.values()) and c["missing"] == 0
        assert c["shares"] == {k: v / c["n"] for k, v in c["counts"].items()}
    # the neutral mention: facts k = 0, 4 state Y there, as in the demand cell
    mention = Counter(r["label"] for r in rows if (r["files"], r["pressure"]) == ("full", "mention"))
    assert mention == {"capitulated": 2 * 3, "supported": 6 * 3}
    # fabrication with evidence deleted, no pressure: even facts invent (k = 0, 2, 4, 6), 3 answers each
    fab = summary["rates"]["fabrication"]["deleted/none"]
    assert (fab["k"], fab["n"]) == (4 * 3, 8 * 3)
    sel = [r for r in rows if (r["files"], r["pressure"]) == ("deleted", "none")]
    per_fact = {}
    for r in sel:
        k, n = per_fact.get(r["fact"], (0, 0))
        per_fact[r["fact"]] = (k + (r["label"] in ("fabricated", "capitulated")), n + 1)
    assert fab["ci95"] == pytest.approx(boot_ci(per_fact, {r["fact"]: r["task"] for r in sel}))
    # capitulation under pressure with full files: even facts capitulate; "chatter" is unparsed, out of n
    cap = summary["rates"]["capitulation"]["full/demand"]
    n_chatter = sum(1 for k in range(8) if k % 2 and k % 3 == 0)
    assert (cap["k"], cap["n"], cap["n_unparsed"]) == (4 * 3, (8 - n_chatter) * 3, n_chatter * 3)
    total = cap["n"] + cap["n_unparsed"]  # bounds: unparsed counted as not capitulating, then as capitulating
    assert cap["bounds"] == pytest.approx([cap["k"] / total, (cap["k"] + cap["n_unparsed"]) / total])
    # every fabrication rate stands beside evidence_on_assertion, with its figures' origin
    [ev] = [p for p in summary["paired"] if p["test"] == "evidence_on_assertion"]
    assert fab["evidence_on_assertion"] == {"diff": ev["diff"], "ci95": ev["ci95"], "p": ev["cluster_test"]["p"],
                                            "n_pairs": ev["n_pairs"]}
    assert (ev["a_only"], ev["b_only"]) == (4 * 3, 0)  # odd facts abstain once the evidence is gone
    assert fab["origin"] == {"copied": 0, "novel": 4 * 3, "equals_truth": 0}  # 987654 is nowhere in the files
    assert summary["rates"]["capitulation"]["deleted/demand"]["rate"] == 1.0
    # paired: deleted/none vs deleted/demand on "asserts without evidence": odd facts abstain then capitulate
    [p] = [p for p in summary["paired"] if p["test"] == "pressure_on_fabrication"]
    assert (p["a_only"], p["b_only"], p["n_pairs"]) == (0, 4 * 3, 8 * 3)
    assert p["p_mcnemar"] == pytest.approx(binomtest(0, 12, 0.5).pvalue)
    # the verdict's test counts tasks: each task's mean difference, signs flipped (exact)
    tasks = {}
    for r in rows:
        if (r["files"], r["pressure"]) == ("deleted", "none"):
            twin = next(x for x in rows if (x["fact"], x["sample"], x["files"], x["pressure"])
                        == (r["fact"], r["sample"], "deleted", "demand"))
            asserts = ("fabricated", "capitulated")
            diff = (twin["label"] in asserts) - (r["label"] in asserts)
            tasks.setdefault(f"{r['pack']}/{r['task']}", []).append(diff)
    assert p["cluster_test"] == pytest.approx(brute_sign_flip([float(np.mean(v)) for v in tasks.values()]))
    # the pressure effect against the mention: facts k = 2, 6 state Y only when it is demanded; k = 0, 4 in
    # both cells; k = 3 chatters under the demand (lost to unparsed)
    [p] = [p for p in summary["paired"] if p["test"] == "pressure_beyond_mention"]
    assert (p["a_only"], p["b_only"], p["both"], p["pairs_lost_to_unparsed"]) == (0, 2 * 3, 2 * 3, 1 * 3)
    [p] = [p for p in summary["paired"] if p["test"] == "mention_on_capitulation"]
    assert (p["a_only"], p["b_only"], p["both"]) == (0, 2 * 3, 0)
    [p] = [p for p in summary["paired"] if p["test"] == "alteration_tracking"]
    assert (p["a_only"], p["b_only"], p["both"]) == (0, 0, 8 * 3) and p["p_mcnemar"] == 1.0
    # the manifest records what made the answers
    manifest = json.loads((out / "entitle.json").read_text())
    assert manifest["settings"]["samples"] == 2 and manifest["packages"]["torch"]
    assert manifest["sampling"]["greedy"]["temperature"] == 0.0
    assert manifest["sampling"]["sampled"]["temperature"] == 0.7 and manifest["backend"] == {"model": "scripted"}


def brute_sign_flip(means: list[float]) -> dict:
    """The exact sign-flip test written out by hand: every assignment of signs, one at a time."""
    from itertools import product

    t = len(means)
    observed = abs(sum(means) / t)
    hits = sum(abs(sum(s * m for s, m in zip(signs, means, strict=True)) / t) >= observed - 1e-12
               for signs in product((1, -1), repeat=t))
    return {"mean": sum(means) / t, "p": hits / 2 ** t, "n_tasks": t, "min_p": min(1.0, 2 / 2 ** t),
            "method": f"exact sign-flip over {t} tasks ({2 ** t} assignments)"}


def test_failed_requests_are_missing_and_asked_again_on_rerun(tmp_path):
    pack = load_pack(PACK)
    items, _ = build_items(pack, 4, seed=0)
    reply, _ = script(pack, items, fail={items[1].fact_id})
    out = tmp_path / "e"
    res = run_entitle(settings(out, facts=4, max_attempts=2), backend=SampledScripted(reply))
    n_item1 = 7 + (items[1].control is not None)
    assert res.errors == n_item1
    assert not any(r["fact"] == items[1].fact_id for r in rows_of(out))  # a failed request stores nothing
    n_planned = 7 * 4 + sum(i.control is not None for i in items)
    assert res.summary["missing"] == n_item1 and res.summary["n_planned"] == n_planned
    assert res.summary["missing_note"] == f"{n_item1} of {n_planned} missing; rerun with the same --out"
    good, _ = script(pack, items)
    backend = SampledScripted(good)
    res = run_entitle(settings(out, facts=4, max_attempts=2), backend=backend)
    assert res.generated == n_item1 and res.errors == 0  # only the failed ones are asked again
    assert len(backend.inner.requests) == n_item1
    assert len(rows_of(out)) == n_planned
    assert res.summary["missing"] == 0
    # nothing left: a third run asks nothing
    backend = SampledScripted(good)
    assert run_entitle(settings(out, facts=4, max_attempts=2), backend=backend).generated == 0
    assert backend.inner.requests == []


def test_a_rerun_with_other_settings_is_refused(tmp_path):
    pack = load_pack(PACK)
    items, _ = build_items(pack, 2, seed=0)
    reply, _ = script(pack, items)
    out = tmp_path / "e"
    run_entitle(settings(out, facts=2), backend=SampledScripted(reply))
    with pytest.raises(InputError, match="settings.seed"):
        run_entitle(settings(out, facts=2, seed=1), backend=SampledScripted(reply))


@pytest.mark.parametrize("args,expected", [
    (["some-model", "a.b=1"], "overrides need a run config"),
    (["missing.yaml"], "no such config file"),
    (["some-model", "--facts", "0"], "--facts"),
    (["some-model", "--facts", "2.5"], "--facts"),
])
@pytest.mark.model  # `lhd entitle run` in a subprocess
def test_bad_input_is_one_clear_line(tmp_path, args, expected):
    """Through the error boundary of the real entry point: exit status 2, one line, no traceback."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "lhd_train.cli", "entitle", "run", *args, "--out",
                           str(tmp_path / "o"), "--no-progress"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert expected in done.stderr and "Traceback" not in done.stderr


def test_relabel_rewrites_the_rounds_labels_and_recounts(tmp_path):
    """A label changed on disk (as an older labeller would have written it) is labelled again by
    `lhd entitle summary --relabel`; the answer's text and the other rounds' bytes are kept."""
    from typer.testing import CliRunner

    from lhd_train.cli.app import app

    pack = load_pack(PACK)
    items, _ = build_items(pack, 2, seed=0)
    reply, _ = script(pack, items)
    out = tmp_path / "e"
    run_entitle(settings(out, facts=2), backend=SampledScripted(reply))
    rows = rows_of(out)
    target = next(r for r in rows if r["label"] == "supported")
    path = out / "trials" / f"{target['trial_id']}.jsonl"
    row = json.loads(path.read_text())
    row["entitle"]["label"] = "abstained"
    path.write_text(json.dumps(row) + "\n")
    others = {p: p.read_bytes() for p in (out / "trials").glob("*.jsonl") if p != path}
    res = CliRunner().invoke(app, ["entitle", "summary", str(out), "--relabel"])
    assert res.exit_code == 0 and "abstained -> supported 1" in res.output, res.output
    again = json.loads(path.read_text())
    assert again["entitle"]["label"] == "supported" and again["performer"] == row["performer"]
    assert all(p.read_bytes() == b for p, b in others.items())
    summary = json.loads((out / "entitle_summary.json").read_text())
    assert sum(c["counts"]["supported"] for c in summary["conditions"]) == sum(r["label"] == "supported" for r in rows)
