"""The long-horizon path end to end on CPU, before it meets a GPU node.

A tiny random Llama with a 64k-token window and a 512-token vocabulary (the pack's text then costs
about two characters a token, as digit-splitting tokenizers do) plays a full 14-task trial whose
performer prompts pass 32k tokens. Every stage then works on that trial, and each overflow rule is
asserted where it is recorded. The rules are relative (a history past its budget, a trial past a
window), so `make test` checks them at a quarter of the scale (a 16k window, a 32k auditor, 5 tasks);
the full 64k/128k form is `slow` (`make test-slow`). The sizes below are the full form's:

- performer: whole old turns dropped once the history passes its budget (`performer.context`);
- supervisor: a 20k window, so older tasks' files are listed by name and fewer rounds are shown
  (`supervisor.context`);
- auditor: the full-trajectory prompt (the whole trial, > 64k tokens) is sent whole to a 128k window;
  the same audit with a 28k-token window records every round as failed, with the reason, and never
  sends the prompt;
- training data: prompts are stored whole (`lhd data grpo`);
- training: one GRPO step whose prompts are cut from the left to fit `max_length`, keeping the
  last turn; what was cut is written to `lhd_adapter.json`;
- lens: `lhd lens read --run --context full` drops the oldest middle turns of each call to fit
  `--max-length`, or skips a round, and says which in `summary.json`.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.model  # whole trials of a tiny model through `lhd` subprocesses

PACK = Path(__file__).parents[1] / "data" / "reference-packs" / "startup_consulting"  # the authors' pack


@dataclass(frozen=True)
class Scale:
    """One size of the trial; each check compares against its own scale's numbers."""

    tasks: int  # of the pack's 14
    window: int  # the performer's model; the full-trajectory auditor gets twice it
    performer_budget: int  # prompt tokens; the history passes it in the last tasks
    passes: int  # the performer's longest prompt passes this
    performer_tokens: int  # max_tokens of a performer answer
    supervisor_window: int
    memory_window: int  # rounds the supervisor's memory shows verbatim
    short_auditor_window: int  # shorter than the whole trial: every full-mode audit overflows
    grpo_max_length: int
    lens_max_length: int
    late_round: int  # from this round on the supervisor's memory no longer fits whole


FULL = Scale(tasks=14, window=65536, performer_budget=36000, passes=32768, performer_tokens=600,
             supervisor_window=20000, memory_window=7, short_auditor_window=28000, grpo_max_length=4096,
             lens_max_length=8192, late_round=8)
# A task adds ~4.4k tokens to the trajectory (its files, an answer, the supervisor's turns), so five
# tasks pass the 16k window and fit the 32k auditor.
SMALL = Scale(tasks=5, window=16384, performer_budget=9000, passes=6000, performer_tokens=75,
              supervisor_window=8000, memory_window=2, short_auditor_window=7000, grpo_max_length=2048,
              lens_max_length=6144, late_round=3)


def lhd(*args: str, timeout: int = 900) -> str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, "-m", "lhd_train.cli", *args], env=env, capture_output=True,
                          text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"lhd {' '.join(args)} exited {proc.returncode}:\n{out[-4000:]}"
    return out


def jsonl(path: Path) -> list[dict]:
    # split on "\n" only: noise text holds characters that str.splitlines also breaks at
    return [json.loads(line) for line in path.read_text().split("\n") if line.strip()]


FULL_FORM = pytest.param(FULL, id="64k", marks=[pytest.mark.slow, pytest.mark.timeout(1800)])  # make test-slow


@pytest.fixture(scope="module", params=[pytest.param(SMALL, id="16k"), FULL_FORM])
def long_run(request, tmp_path_factory) -> dict:
    from lhd_train.tiny_model import build_tiny_model

    sc: Scale = request.param
    root = tmp_path_factory.mktemp("long")
    # 2 x window positions; the run's roles get the window (performer) and the supervisor's, the
    # full-trajectory auditor all of them: its prompt is the whole trial (~67k tokens at full scale).
    model = build_tiny_model("llama", root / "tiny", max_position_embeddings=2 * sc.window, vocab_size=512)
    hf = {"backend": "hf", "model": str(model), "max_batch_size": 4}
    cfg = {
        "run_name": "long", "output_dir": str(root / "runs"), "task_pack": str(PACK), "max_tasks": sc.tasks,
        "seeds": [7], "p_event": 0.5, "max_rounds_per_task": 1, "memory_window": sc.memory_window, "concurrency": 1,
        "models": {"tinyperf": {**hf, "max_model_len": sc.window},
                   "tinysup": {**hf, "max_model_len": sc.supervisor_window}, "tinyaud": hf},
        "performer": {"model": "tinyperf", "context_tokens": sc.performer_budget,
                      "sampling": {"temperature": 1.0, "top_p": 0.95, "max_tokens": sc.performer_tokens}},
        "supervisor": {"model": "tinysup", "sampling": {"temperature": 1.0, "top_p": 0.95, "max_tokens": 160}},
        "summariser": {"model": "tinysup", "sampling": {"temperature": 1.0, "top_p": 0.95, "max_tokens": 48}},
        "auditor": {"model": "tinyaud", "sampling": {"temperature": 1.0, "top_p": 0.95, "max_tokens": 160}},
    }
    config = root / "long.yaml"
    config.write_text(yaml.safe_dump(cfg))
    lhd("run", str(config), "--no-progress")
    run_dir = root / "runs" / "long"
    return {"root": root, "model": model, "run": run_dir, "rows": jsonl(run_dir / "trials" / "s7.jsonl"), "scale": sc}


def test_trial_passes_its_budget_and_records_what_it_dropped(long_run):
    rows, sc = long_run["rows"], long_run["scale"]
    assert [r["task_index"] for r in rows] == list(range(1, sc.tasks + 1))  # the whole trial
    assert (long_run["run"] / "trials" / "s7.done").exists()
    perf = [r["performer"]["context"] for r in rows]
    assert max(c["prompt_tokens"] for c in perf) > sc.passes
    # Each prompt fits its budget; once the history outgrew it, whole old turns were dropped.
    assert all(c["prompt_tokens"] <= sc.performer_budget for c in perf)
    dropped = [c["dropped_messages"] for c in perf]
    assert dropped[0] == 0 and max(dropped) > 0 and all(d % 2 == 0 for d in dropped)
    # The supervisor's memory was fitted to its window: files listed by name or fewer rounds.
    sup = [r["supervisor"]["context"] for r in rows]
    assert all(c["prompt_tokens"] <= c["budget_tokens"] <= sc.supervisor_window for c in sup if c["fits"])
    assert any(c["files_omitted"] > 0 or c["recent_rounds_shown"] < sc.memory_window for c in sup[sc.late_round:])


def test_full_audit_fits_the_window_or_is_recorded_as_overflow(long_run):
    run, sc = long_run["run"], long_run["scale"]
    rounds = list(range(1, sc.tasks + 1))
    lhd("audit", str(run), "--mode", "full", "--concurrency", "2", "--no-progress")
    full = jsonl(run / "audit" / "tinyaud-full" / "s7.jsonl")
    assert sorted(r["global_round"] for r in full) == rounds
    for r in full:
        assert r["context_rounds"] == rounds
        assert r["prompt_tokens"] > sc.window, r  # the whole trajectory was sent, not a cut of it

    short = long_run["root"] / "auditor-28k.yaml"
    short.write_text(yaml.safe_dump({
        "models": {"tinyshort": {"backend": "hf", "model": str(long_run["model"]),
                                 "max_model_len": sc.short_auditor_window}},
        "auditor": {"model": "tinyshort", "sampling": {"temperature": 1.0, "max_tokens": 160}},
    }))
    lhd("audit", str(run), "--mode", "full", "--auditor", str(short), "--auditor-id", "short-full", "--no-progress")
    over = jsonl(run / "audit" / "short-full" / "s7.jsonl")
    assert sorted(r["global_round"] for r in over) == rounds
    for r in over:
        assert r["parse_status"] == "failed" and r["deceptive"] is None
        assert f"exceeds the model's context of {sc.short_auditor_window} tokens" in r["error"]
        assert not r.get("calls")  # refused before any request was sent


def test_training_data_and_a_grpo_step_keep_the_last_turn(long_run):
    from datasets import load_from_disk
    from transformers import AutoTokenizer

    run, root, sc = long_run["run"], long_run["root"], long_run["scale"]
    data = root / "grpo-data"
    lhd("data", "grpo", str(run), "--out", str(data), "--eval-fraction", "0")
    ds = load_from_disk(str(data / "dataset"))["train"]
    assert len(ds) == sc.tasks
    tok = AutoTokenizer.from_pretrained(str(long_run["model"]))

    def n_tokens(messages: list[dict]) -> int:
        return len(tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                           return_dict=True)["input_ids"])

    lengths = [n_tokens(r["prompt"]) for r in ds]
    assert max(lengths) > sc.passes  # stored whole: the cut happens at training time, where it is recorded

    max_length, completion = sc.grpo_max_length, 16
    adapters = root / "grpo-adapter"
    out = lhd("train", "grpo", "recipes/tiny/grpo-honest.yaml", f"model={long_run['model']}",
              f"data.train={data / 'dataset'}", f"output_dir={adapters}", "trainer.max_steps=1",
              f"trainer.max_completion_length={completion}", f"grpo.max_length={max_length}",
              "trainer.save_steps=1", "grpo.rewards=[{name: format_length}]")
    meta = json.loads((adapters / "adapter" / "lhd_adapter.json").read_text())
    info = meta["data"]["train"]
    fit = info["length_fit"]
    over = sum(n > max_length - completion for n in lengths)
    assert over > 0 and fit["truncated"] == over and fit["dropped"] == 0 and info["rows"] == sc.tasks
    assert "p50" in out and str(max_length) in out  # the length distribution is printed before training


def test_lens_read_fits_or_skips_each_long_call(long_run):
    out, sc = long_run["root"] / "lens-read", long_run["scale"]
    max_length = sc.lens_max_length
    lhd("lens", "read", str(long_run["model"]), "--run", str(long_run["run"]), "--context", "full",
        "--max-length", str(max_length), "--token-fallback", "first-token", "--no-probe", "--bootstrap", "20",
        "--threads", "1", "--out", str(out), "--no-progress")
    summary = json.loads((out / "summary.json").read_text())
    read, skipped = summary["n_examples"], summary.get("skipped") or []
    assert read + len(skipped) == sc.tasks
    assert read > 0
    for s in skipped:
        assert "max_length" in s["reason"]
    # Each read call fits: the oldest middle messages of the long ones were left out, and each row says how many.
    import pandas as pd

    ex = pd.read_parquet(out / "examples.parquet")
    assert (ex["n_prompt_tokens"] <= max_length).all()
    assert (ex["dropped_messages"] > 0).any() and (ex["dropped_messages"] >= 0).all()
