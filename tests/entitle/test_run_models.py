"""`lhd entitle` with real models: the tiny random Llama for the plumbing (token ids, read, steer,
resume through the CLI), and SmolLM2-135M-Instruct for the slow test that measures a real model."""
from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import pytest
from entitle_disk import answers_on_disk
from transformers import AutoTokenizer
from typer.testing import CliRunner

from lhd_train.cli.app import app


def lhd(*args: str):
    res = CliRunner().invoke(app, list(args))
    assert res.exit_code == 0, (res.output, res.exception)
    return res


def rows_of(out: Path) -> list[dict]:
    """The stored answers with their full context (through the CLI's --answers for the text, the
    trial files for the token ids)."""
    return answers_on_disk(out)


def test_tiny_model_run_read_steer(tmp_path, tiny_llama_dir):
    """Two packs, so steering rebuilds each answer's prompt from its own pack."""
    out = tmp_path / "e"
    lhd("entitle", "run", str(tiny_llama_dir), "--out", str(out), "--pack", "lhd_startup_consulting,lhd_event_planning",
        "--facts", "2", "--samples", "1", "--max-tokens", "8", "--no-control", "--no-progress")
    rows = rows_of(out)
    assert len(rows) == 2 * 7 * 2
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    for path in (out / "trials").glob("*.messages.jsonl"):  # the stored ids are the exact context
        messages = [json.loads(line) for line in path.read_text().splitlines()]
        [row] = [json.loads(line) for line in path.with_name(path.name.replace(".messages", "")).read_text()
                 .splitlines()]
        context = [{"role": m["role"], "content": m["content"]} for m in messages if m["role"] != "assistant"]
        prompt = tok.apply_chat_template(context, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert row["entitle"]["prompt_token_ids"] == list(prompt)
        assert tok.decode(row["performer"]["token_ids"], skip_special_tokens=True) == row["performer"]["text"]
    greedy = {r["id"]: r["answer"] for r in rows if r["sample"] == 0}
    summary = json.loads((out / "entitle_summary.json").read_text())
    for c in summary["conditions"]:
        mine = Counter(r["label"] for r in rows if (r["files"], r["pressure"]) == (c["files"], c["pressure"]))
        assert {k: v for k, v in c["counts"].items() if v} == dict(mine)
    # a second directory with the same settings asks for the same greedy answers
    lhd("entitle", "run", str(tiny_llama_dir), "--out", str(tmp_path / "f"), "--pack",
        "lhd_startup_consulting,lhd_event_planning", "--facts", "2", "--max-tokens", "8", "--no-control",
        "--no-progress")
    assert {r["id"]: r["answer"] for r in rows_of(tmp_path / "f")} == greedy
    # read: the random model's answers hold no fabricated/supported pair of a fact, and it says so
    res = lhd("entitle", "read", str(out), "--no-progress", "--bootstrap", "20")
    plan = json.loads((out / "read" / "plan.json").read_text())
    assert plan["primary"]["readout"] == "logit"
    assert ("nothing to compare" in res.output) == (json.loads((out / "read" / "summary.json").read_text())
                                                    ["n_answers"] == 0)
    # a tuned lens is read beside the logit lens, and the plan names it by its checksum before anything is read
    import torch

    from lens.tuned import TunedLens, save_tuned_lens

    cfg = json.loads((tiny_llama_dir / "config.json").read_text())
    d, n = cfg["hidden_size"], cfg["num_hidden_layers"]
    tuned = save_tuned_lens(TunedLens({k: torch.zeros(d, d) for k in range(n - 1)},
                                      {k: torch.zeros(d) for k in range(n - 1)}), tmp_path / "T")
    lhd("entitle", "read", str(out), "--tuned-lens", str(tuned), "--out", str(tmp_path / "rt"), "--no-progress",
        "--bootstrap", "20")
    plan = json.loads((tmp_path / "rt" / "plan.json").read_text())
    assert "tuned" in plan["readouts"]
    assert plan["lenses"] == {"tuned": json.loads((tuned / "tuned.json").read_text())["sha256"]}
    # steer: baseline, the entitlement direction and one random one, per fact of the deleted cell
    lhd("entitle", "steer", str(out), "--alpha", "4", "--random", "1", "--cell", "deleted/none", "--no-progress")
    steered = rows_of(out / "steer")
    assert Counter(r["steer_direction"] for r in steered) == {"none": 2, "entitlement": 2, "random1": 2}
    base = {r["fact"]: r for r in steered if r["steer_direction"] == "none"}
    assert {r["fact"]: r["answer"] for r in base.values()} == {r["fact"]: r["answer"] for r in rows
                                                              if (r["files"], r["sample"]) == ("deleted", 0)
                                                              and r["pressure"] == "none"}
    s = json.loads((out / "steer" / "entitle_summary.json").read_text())
    for o in s["directions"][1:]:
        sel = [r for r in steered if r["steer_direction"] == o["direction"]]
        asserts = [r for r in sel if r["label"] in ("fabricated", "capitulated")]
        assert (o["fabrication"]["k"], o["fabrication"]["n"]) == (
            len(asserts), sum(r["label"] != "unparsed" for r in sel))
        pairs = [(base[r["fact"]]["label"] in ("fabricated", "capitulated"), r in asserts) for r in sel
                 if "unparsed" not in (r["label"], base[r["fact"]]["label"])]
        assert (o["vs_unsteered"]["n_pairs"], o["vs_unsteered"]["a_only"], o["vs_unsteered"]["b_only"]) == (
            len(pairs), sum(a and not b for a, b in pairs), sum(b and not a for a, b in pairs))


@pytest.mark.parametrize("facts", [4, pytest.param(20, marks=[pytest.mark.slow, pytest.mark.timeout(1800)])])
def test_smollm2_facts_by_seven_cells(tmp_path, smollm2_dir, facts):
    """Facts of the four built-in packs x the seven cells, greedy, 48-token answers, counted back from the rows. At
    20 facts (`make test-slow`): the timing and the numbers of docs/entitle.md; the time limit is the issue's
    (10 minutes on two cores), on a loaded machine reported, not asserted (LHD_ASSERT_TIME=1 asserts it). At 4
    facts the same path in `make test`."""
    import os

    out = tmp_path / "smol"
    t0 = time.time()
    lhd("entitle", "run", str(smollm2_dir), "--out", str(out), "--facts", str(facts), "--no-control",
        "--max-tokens", "48", "--no-progress")
    took = time.time() - t0
    rows = rows_of(out)
    assert len(rows) == 7 * facts and not any(r["label"] == "error" for r in rows)
    summary = json.loads((out / "entitle_summary.json").read_text())
    assert sum(c["n"] for c in summary["conditions"]) == 7 * facts and summary["missing"] == 0
    for c in summary["conditions"]:
        mine = Counter(r["label"] for r in rows if (r["files"], r["pressure"]) == (c["files"], c["pressure"]))
        assert {k: v for k, v in c["counts"].items() if v} == dict(mine)
    print(f"SmolLM2 entitle run: {took:.0f} s; " + "; ".join(
        f"{c['files']}/{c['pressure']}: " + ", ".join(f"{k} {v}" for k, v in c["counts"].items() if v)
        for c in summary["conditions"]))
    if os.environ.get("LHD_ASSERT_TIME") and facts == 20:
        assert took < 600


def test_a_run_config_with_an_adapter_as_the_demo_uses_it(tmp_path, tiny_llama_dir):
    """configs/tiny.yaml with performer.adapter=..., as `make demo` runs it for the adapter; then
    the read merges the adapter, steering runs on the adapted model, and compare pairs the two."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_llama_dir),
                                LoraConfig(r=4, lora_alpha=64, target_modules=["q_proj", "v_proj"],
                                           init_lora_weights=False))
    peft_model.save_pretrained(tmp_path / "adapter")
    root = Path(__file__).resolve().parents[2]
    common = ["--facts", "2", "--max-tokens", "8", "--no-control", "--no-progress"]
    model = f"models.tiny.model={tiny_llama_dir}"
    lhd("entitle", "run", str(root / "configs/tiny.yaml"), model, "--out", str(tmp_path / "base"), *common)
    lhd("entitle", "run", str(root / "configs/tiny.yaml"), model, f"performer.adapter={tmp_path / 'adapter'}",
        "--out", str(tmp_path / "sft"), *common)
    base, sft = rows_of(tmp_path / "base"), rows_of(tmp_path / "sft")
    adapters = {}
    for name in ("base", "sft"):
        adapters[name] = {json.loads(p.read_text().splitlines()[0])["models"]["performer"].get("adapter")
                          for p in (tmp_path / name / "trials").glob("a*[0-9a-f].jsonl")}
    assert adapters == {"sft": {str(tmp_path / "adapter")}, "base": {None}}
    assert [r["answer"] for r in base] != [r["answer"] for r in sft]  # the adapter changes the answers
    res = lhd("entitle", "compare", str(tmp_path / "base"), str(tmp_path / "sft"))
    assert "fabrication" in res.output
    lhd("entitle", "read", str(tmp_path / "sft"), "--no-progress", "--bootstrap", "10")
    lhd("entitle", "steer", str(tmp_path / "sft"), "--random", "0", "--cell", "deleted/none", "--no-progress")
    steered = rows_of(tmp_path / "sft" / "steer")
    assert {r["steer_direction"] for r in steered} == {"none", "entitlement"}
