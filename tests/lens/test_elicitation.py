"""Run mode reads the answer: the stated margin is the model's own Yes−No after an elicitation turn
(science-4 D10), anchors before the answer are negative controls (D1), the echo covariate counts the
set words the read position sees, and the primary cell is on disk before any AUROC is computed."""
from __future__ import annotations

import json

import pandas as pd
import pytest
import torch
from test_read import FLAGS, invoke, runner, write_run

from lens.elicit import elicitation, resolve_answer_sets
from lens.errors import LensError
from lens.margins import resolve_token_sets
from lens.positions import tag_chat_prompt
from lens.readout import LogitLens
from lhd_train.cli.lens import app
from lhd_train.config.lens import ReadSettings
from lhd_train.reading import preregister, tables
from lhd_train.reading.read import collect, read_run
from lhd_train.reading.runs import load_run_examples


def _yes_no_ids(tok):
    """Single-token forms of yes / no, found here without lens.elicit."""
    def ids(word):
        out = []
        for form in (word, " " + word, word.capitalize(), " " + word.capitalize()):
            t = tok(form, add_special_tokens=False)["input_ids"]
            if len(t) == 1 and t[0] not in out:
                out.append(t[0])
        return out
    return ids("yes"), ids("no")


def test_stated_is_the_models_own_yes_no_after_the_answer(tmp_path, qwen):
    model, tok = qwen
    run = write_run(tmp_path, FLAGS)
    examples, _ = load_run_examples(run)
    sets = resolve_token_sets(tok)
    col = collect(model, tok, examples[:3], [LogitLens(model)], sets, ReadSettings(progress=False, probe=False))
    yes, no = _yes_no_ids(tok)
    assert yes and no
    for ex, got in zip(examples[:3], col.examples, strict=True):
        tag = tag_chat_prompt(tok, ex.messages, ex.spans, judged="answer")
        text = tok.decode(tag.input_ids)
        # the answer comes before the elicitation, which is the last user turn before the generation prompt
        assert text.index(ex.answer) < text.index(elicitation()) < len(text)
        with torch.no_grad():
            logits = model.hf(input_ids=torch.tensor([tag.input_ids])).logits[0, -1].float()
        want = float(torch.logsumexp(logits[yes], 0) - torch.logsumexp(logits[no], 0))
        assert got["stated_yes_no"] == pytest.approx(want, abs=1e-4)
        # echo: the set tokens the decision position sees (the whole prompt), recounted here
        ids = tag.input_ids
        assert got["echo_S"] == sum(ids.count(t) for t in sets.S)
        assert got["echo_N"] == sum(ids.count(t) for t in sets.N)
        assert got["echo_yes"] == sum(ids.count(t) for t in yes) and got["echo_no"] == sum(ids.count(t) for t in no)
        rows = [r for r in col.rows if r["example_id"] == ex.example_id and r["position"] == "record_end"]
        r_end = tag.positions["record_end"]
        assert rows[0]["echo_S"] == sum(ids[:r_end + 1].count(t) for t in sets.S)
        assert rows[0]["control"] and not next(r for r in col.rows if r["example_id"] == ex.example_id
                                               and r["position"] == "decision")["control"]


def test_compact_record_anchor_is_one_state_per_task(tmp_path, qwen):
    """In compact context the record precedes everything trial-specific: its margin is the same in
    every trial of a task, so its within-task AUROC is exactly 0.5, and it is labelled a control."""
    model, tok = qwen
    run = write_run(tmp_path, FLAGS)
    out = tmp_path / "read"
    read_run(model, tok, None, run, resolve_token_sets(tok), out,
             ReadSettings(progress=False, probe=False, bootstrap=20, primary_readout="logit"), context="compact")
    m = pd.read_parquet(out / "margins.parquet")
    tasks = pd.read_parquet(out / "examples.parquet")[["example_id", "task_index"]]
    rec = m[m["position"] == "record_end"].merge(tasks)
    spread = rec.groupby(["task_index", "layer"])["m_E"].agg(lambda v: v.max() - v.min())
    assert spread.max() < 1e-5
    table = pd.read_csv(out / "auroc.csv")
    r = table[table["position"] == "record_end"]
    assert set(r["metric_key"]) == {"internal"}  # the gap pairs with the stated answer: only where both see it
    assert len(r) and (r["auroc_within"] == 0.5).all() and set(r["role"]) == {"negative control"}
    md = (out / "auroc.md").read_text()
    assert md.index("# Negative controls") < md.index("# Exploratory")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["run"]["context"] == "compact" and "ablation" in md


def test_the_primary_cell_is_on_disk_before_any_auroc(tmp_path, qwen, monkeypatch):
    model, tok = qwen
    run = write_run(tmp_path, FLAGS)
    out = tmp_path / "read"
    seen = []
    real = tables.bootstrap_auroc

    def spy(*args, **kwargs):
        if not seen:
            seen.append(json.loads((out / "plan.json").read_text()))
        return real(*args, **kwargs)

    monkeypatch.setattr(tables, "bootstrap_auroc", spy)
    cfg = ReadSettings(progress=False, probe=False, bootstrap=0, primary_readout="logit", primary_metric="gap",
                     band_start=0.5, band_end=1.0)
    summary = read_run(model, tok, None, run, resolve_token_sets(tok), out, cfg)
    assert seen and seen[0]["sha256"] == summary["sha256"] == preregister.plan_digest(seen[0])
    assert seen[0]["primary"] == {"metric": "gap", "readout": "logit", "anchor": "decision", "band": [0.5, 1.0],
                                  "band_layers": [1, 2]}
    assert summary["primary_result"]["declared"]["metric"] == "gap" and summary["primary_result"]["found"]
    with pytest.raises(LensError, match="declares another plan"):  # the folder keeps the plan it declared
        read_run(model, tok, None, run, resolve_token_sets(tok), out,
                 cfg.model_copy(update={"primary_metric": "internal"}))


def test_a_negative_control_cannot_be_declared_primary_in_run_mode(tmp_path, qwen):
    model, tok = qwen
    run = write_run(tmp_path, FLAGS)
    with pytest.raises(LensError, match="record_end.*negative control"):
        read_run(model, tok, None, run, resolve_token_sets(tok), tmp_path / "o",
                 ReadSettings(progress=False, primary_anchor="record_end"))
    bad = runner.invoke(app, ["read", "m", "--run", str(run), "--out", str(tmp_path / "o2"), "--band-start", "0.9",
                              "--band-end", "0.2"])
    assert bad.exit_code == 2 and "band" in bad.output


def test_answer_sets_resolve_single_tokens(qwen):
    _, tok = qwen
    sets = resolve_answer_sets(tok)
    assert (sets.yes, sets.no) == _yes_no_ids(tok)
    with pytest.raises(LensError, match="first-token"):
        resolve_answer_sets(tok, yes=("xqzjwkvpq",))


def test_full_is_the_default_context(tmp_path, tiny_dirs):
    run = write_run(tmp_path, FLAGS)
    out = tmp_path / "r"
    invoke("read", tiny_dirs["llama"], "--run", run, "--out", out, "--bootstrap", 0, "--no-probe", "--no-progress",
           "--primary-readout", "logit")
    s = json.loads((out / "summary.json").read_text())
    assert s["run"]["context"] == "full" and s["config"]["primary_readout"] == "logit"
