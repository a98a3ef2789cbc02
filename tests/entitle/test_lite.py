"""Entitle lite mode: the log-probabilities on disk against a plain forward pass, the
counterbalancing, resuming, and the summary and its task-level test recounted from the rows."""
from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from lhd_train.bench.taskpack import list_builtin_packs, load_pack
from lhd_train.entitle.figures import parse_value
from lhd_train.entitle.items import file_figures, in_figures
from lhd_train.entitle.lite import ROWS, lite_facts, read_rows, run_lite
from lhd_train.entitle.lite_prompts import (
    ABSTAIN,
    CELLS,
    DELETED,
    FULL,
    MENTION,
    REAL,
    X,
    continuations,
    encode,
    evidence_file,
    messages,
    prompt_text,
)
from lhd_train.entitle.lite_summary import BOOTSTRAP, OUTCOMES, describe, summarise_lite
from lhd_train.entitle.settings import EntitleRunCommand
from lhd_train.errors import InputError

PACK = "lhd_startup_consulting"


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: Path):
    from lens.model import load_hf

    return load_hf(str(tiny_llama_dir))


def _settings(model_dir: Path, out: Path, **kw) -> EntitleRunCommand:
    return EntitleRunCommand(model_or_config=str(model_dir), out=out, mode="lite", pack=kw.pop("pack", PACK),
                             facts=kw.pop("facts", 4), progress=False, **kw)


@pytest.fixture(scope="module")
def lite_dir(tiny, tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("lite") / "d"
    model, tok = tiny
    run_lite(_settings(tiny_llama_dir, out), model, tok)
    return out


def test_logprobs_on_disk_match_a_plain_forward_pass(lite_dir: Path, tiny) -> None:
    model, tok = tiny
    rows = [json.loads(line) for line in (lite_dir / ROWS).read_text().splitlines()]
    assert {r["cell"] for r in rows} == {f"{f}/{p}" for f, p in CELLS}
    facts = {f.item.fact_id: f for f in lite_facts([load_pack(PACK)], _settings(Path("m"), lite_dir))[0]}
    pack = load_pack(PACK)
    for r in rows[:8]:
        fact = facts[r["fact"]]
        text = prompt_text(tok, messages(pack.task(fact.item.task), fact, r["files"], r["pressure"]))
        assert text.rstrip().endswith(f"of {fact.item.entity} is" if fact.item.entity else " is")
        for name, c in r["continuations"].items():
            p, ids = encode(tok, text, c["text"])
            assert c["tokens"] == len(ids) > 0
            seq = torch.tensor([p + ids])
            logp = torch.log_softmax(model.hf(input_ids=seq).logits.float(), -1)[0]
            want = sum(float(logp[len(p) - 1 + j, t]) for j, t in enumerate(ids))
            assert c["logprob"] == pytest.approx(want, abs=1e-3), (r["fact"], r["cell"], name)


def test_prompt_holds_the_evidence_file_only_and_prefills_the_answer(tiny) -> None:
    _, tok = tiny
    pack = load_pack(PACK)
    fact = lite_facts([pack], _settings(Path("m"), Path("o")))[0][0]
    task = pack.task(fact.item.task)
    msgs = messages(task, fact, FULL, MENTION)
    others = [f.name for f in task.files if f.name != fact.item.file]
    assert fact.item.file in msgs[1]["content"] and not any(f"file: {n} " in msgs[1]["content"] for n in others)
    assert fact.item.demanded in msgs[1]["content"] and "Put " not in msgs[1]["content"]
    text = prompt_text(tok, msgs)
    assert text.endswith(msgs[2]["content"]) and text.count("<|im_start|>assistant") == 1


def test_counterbalancing_shows_a_drawn_value_for_half_the_facts() -> None:
    packs = [load_pack(n) for n in list_builtin_packs()]
    facts, _ = lite_facts(packs, _settings(Path("m"), Path("o"), pack=None, facts=None))
    flagged = [f for f in facts if f.counterbalanced]
    # half are drawn for; a few keep their value where no free number of their format exists
    assert len(facts) / 2 - 10 <= len(flagged) <= len(facts) / 2 + 1
    assert len({(f.item.pack, f.item.task) for f in facts}) >= 30
    by_pack = {p.name: p for p in packs}
    for f in facts:
        task = by_pack[f.item.pack].task(f.item.task)
        shown = evidence_file(task, f, FULL).content
        line_start = f.item.line[0]
        original = next(x for x in task.files if x.name == f.item.file).content
        if f.counterbalanced:
            assert f.x not in (f.item.value, f.item.altered, f.item.demanded)
            assert not in_figures(parse_value(f.x), file_figures(task))
            assert shown != original and f.x in shown[line_start:] and REAL in continuations(f)
        else:
            assert shown == original and f.x == f.item.value and REAL not in continuations(f)
        assert continuations(f)[X] == " " + f.x and continuations(f)["abstain"] == ABSTAIN
        assert original[line_start:f.item.line[1]] not in evidence_file(task, f, DELETED).content
    again, _ = lite_facts(packs, _settings(Path("m"), Path("o"), pack=None, facts=None))
    assert [f.x for f in again] == [f.x for f in facts]
    other, _ = lite_facts(packs, _settings(Path("m"), Path("o"), pack=None, facts=None, seed=1))
    assert {f.item.fact_id for f in other if f.counterbalanced} != {f.item.fact_id for f in flagged}


def test_resume_scores_only_missing_rows_and_refuses_other_settings(lite_dir: Path, tiny, tiny_llama_dir: Path,
                                                                    tmp_path: Path) -> None:
    model, tok = tiny
    out = tmp_path / "d"
    out.mkdir()
    for name in ("lite.json", "lite_items.jsonl"):
        (out / name).write_text((lite_dir / name).read_text())
    lines = (lite_dir / ROWS).read_text().splitlines(keepends=True)
    (out / ROWS).write_text("".join(lines[:7]) + lines[7][:20])  # a torn last line, as after a crash
    res = run_lite(_settings(tiny_llama_dir, out), model, tok)
    assert res.scored == len(lines) - 7
    got = {(r["fact"], r["cell"]): r["continuations"] for r in read_rows(out)}
    want = {(r["fact"], r["cell"]): r["continuations"] for r in read_rows(lite_dir)}
    assert got.keys() == want.keys()
    for k in want:
        for c in want[k]:
            assert got[k][c]["logprob"] == pytest.approx(want[k][c]["logprob"], abs=1e-4)
    assert run_lite(_settings(tiny_llama_dir, out), model, tok).scored == 0
    with pytest.raises(InputError, match="seed"):
        run_lite(_settings(tiny_llama_dir, out, seed=3), model, tok)


def _brute_force_p(d: np.ndarray) -> float:
    obs = abs(d.mean())
    means = [abs((d * np.array(s)).mean()) for s in itertools.product((1, -1), repeat=len(d))]
    return float(np.mean([m >= obs - 1e-12 for m in means]))


def test_summary_recounted_from_rows_with_exact_sign_flip(lite_dir: Path) -> None:
    from scipy import stats

    summary = json.loads((lite_dir / "lite_summary.json").read_text())
    rows = [json.loads(line) for line in (lite_dir / ROWS).read_text().splitlines()]
    lp = {(r["fact"], r["cell"], k): c["logprob"] for r in rows for k, c in r["continuations"].items()}
    task = {r["fact"]: (r["pack"], r["task"]) for r in rows}
    evidence = {f: lp[(f, "full/none", "X")] - lp[(f, "deleted/none", "X")] for f in task}
    pressure = {f: lp[(f, "full/demand", "Y")] - lp[(f, "full/mention", "Y")] for f in task}
    for name, per_fact in (("evidence", evidence), ("pressure_vs_mention", pressure)):
        o = summary["outcomes"][name]
        vals = np.array(list(per_fact.values()))
        assert o["n_facts"] == len(vals) and o["mean"] == pytest.approx(vals.mean(), abs=1e-9)
        assert o["facts_positive"] == int((vals > 0).sum())
        tasks = sorted(set(task.values()))
        tmeans = np.array([np.mean([v for f, v in per_fact.items() if task[f] == t]) for t in tasks])
        assert o["p_task_sign_flip"] == pytest.approx(_brute_force_p(tmeans), abs=1e-9)
        scipy_p = stats.permutation_test((tmeans,), np.mean, permutation_type="samples", n_resamples=np.inf).pvalue
        assert o["p_task_sign_flip"] == pytest.approx(scipy_p, abs=1e-9)
        lo, hi = o["ci95_task_bootstrap"]
        assert lo <= vals.mean() <= hi
    assert set(summary["outcomes"]) == set(OUTCOMES)
    assert summary["top_choice"]["full/none"]["n"] == len(task)


def test_the_task_interval_resamples_whole_clusters() -> None:
    """`describe`'s interval is lhd's one cluster bootstrap (lens.stats): the plain loop below, a mean over the
    facts of the drawn tasks; one task gives no interval."""
    values = np.array([1.0, 1.0, 1.0, 5.0, 9.0])
    clusters = ["a", "a", "a", "b", "c"]
    lo, hi = describe(values, clusters)["ci95_task_bootstrap"]
    draws = np.random.default_rng(0).integers(0, 3, size=(BOOTSTRAP, 3))
    sums, counts = np.array([3.0, 5.0, 9.0]), np.array([3.0, 1.0, 1.0])
    means = sums[draws].sum(1) / counts[draws].sum(1)
    assert (lo, hi) == pytest.approx(tuple(np.quantile(means, [0.025, 0.975])))
    assert describe(values, ["a"] * 5)["ci95_task_bootstrap"] is None


def test_summary_of_a_lite_dir_through_the_cli(lite_dir: Path) -> None:
    from typer.testing import CliRunner

    from lhd_train.cli.entitle import app

    res = CliRunner().invoke(app, ["summary", str(lite_dir), "--json"])
    assert res.exit_code == 0, res.output
    printed = json.loads(res.output)
    assert printed["outcomes"] == summarise_lite(read_rows(lite_dir))["outcomes"]
