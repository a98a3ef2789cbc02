"""The long-horizon path end to end on CPU, before it meets a GPU node.

A tiny random Llama with a 64k-token window and a 512-token vocabulary (the pack's text then costs
about two characters a token, as digit-splitting tokenizers do) plays a full 14-task trial whose
performer prompts pass 32k tokens. Every stage then works on that trial, and each overflow rule is
asserted where it is recorded:

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
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow

PACK = Path(__file__).parents[1] / "data" / "reference-packs" / "startup_consulting"  # the authors' pack
WINDOW = 65536
PERFORMER_BUDGET = 36000  # prompt tokens; the history passes it in the last tasks
SUPERVISOR_WINDOW = 20000
SHORT_AUDITOR_WINDOW = 28000


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


@pytest.fixture(scope="module")
def long_run(tmp_path_factory) -> dict:
    from lhd_train.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("long")
    # 128k positions; the run's roles get a 64k (performer) and a 20k (supervisor) window, the
    # full-trajectory auditor the whole 128k: its prompt is the whole trial (~67k tokens).
    model = build_tiny_model("llama", root / "tiny", max_position_embeddings=2 * WINDOW, vocab_size=512)
    hf = {"backend": "hf", "model": str(model), "max_batch_size": 4}
    cfg = {
        "run_name": "long", "output_dir": str(root / "runs"), "task_pack": str(PACK),
        "seeds": [7], "p_event": 0.5, "max_rounds_per_task": 1, "memory_window": 7, "concurrency": 1,
        "models": {"tiny64k": {**hf, "max_model_len": WINDOW}, "tiny20k": {**hf, "max_model_len": SUPERVISOR_WINDOW},
                   "tiny128k": hf},
        "performer": {"model": "tiny64k", "context_tokens": PERFORMER_BUDGET,
                      "sampling": {"temperature": 1.0, "top_p": 0.95, "max_tokens": 600}},
        "supervisor": {"model": "tiny20k", "sampling": {"temperature": 1.0, "top_p": 0.95, "max_tokens": 160}},
        "summariser": {"model": "tiny20k", "sampling": {"temperature": 1.0, "top_p": 0.95, "max_tokens": 48}},
        "auditor": {"model": "tiny128k", "sampling": {"temperature": 1.0, "top_p": 0.95, "max_tokens": 160}},
    }
    config = root / "long.yaml"
    config.write_text(yaml.safe_dump(cfg))
    lhd("run", str(config), "--no-progress")
    run_dir = root / "runs" / "long"
    return {"root": root, "model": model, "run": run_dir, "rows": jsonl(run_dir / "trials" / "s7.jsonl")}


def test_trial_passes_32k_and_records_what_it_dropped(long_run):
    rows = long_run["rows"]
    assert [r["task_index"] for r in rows] == list(range(1, 15))  # the full 14-task trial
    assert (long_run["run"] / "trials" / "s7.done").exists()
    perf = [r["performer"]["context"] for r in rows]
    assert max(c["prompt_tokens"] for c in perf) > 32768
    # Each prompt fits its budget; once the history outgrew it, whole old turns were dropped.
    assert all(c["prompt_tokens"] <= PERFORMER_BUDGET for c in perf)
    dropped = [c["dropped_messages"] for c in perf]
    assert dropped[0] == 0 and max(dropped) > 0 and all(d % 2 == 0 for d in dropped)
    # The supervisor's memory was fitted to its 20k window: files listed by name or fewer rounds.
    sup = [r["supervisor"]["context"] for r in rows]
    assert all(c["prompt_tokens"] <= c["budget_tokens"] <= SUPERVISOR_WINDOW for c in sup if c["fits"])
    assert any(c["files_omitted"] > 0 or c["recent_rounds_shown"] < 7 for c in sup[8:])


def test_full_audit_fits_the_window_or_is_recorded_as_overflow(long_run):
    run = long_run["run"]
    lhd("audit", str(run), "--mode", "full", "--concurrency", "2", "--no-progress")
    full = jsonl(run / "audit" / "tiny128k-full" / "s7.jsonl")
    assert sorted(r["global_round"] for r in full) == list(range(1, 15))
    for r in full:
        assert r["context_rounds"] == list(range(1, 15))
        assert r["prompt_tokens"] > 2 * 32768  # the whole trajectory was sent, not a cut of it

    short = long_run["root"] / "auditor-28k.yaml"
    short.write_text(yaml.safe_dump({
        "models": {"tiny28k": {"backend": "hf", "model": str(long_run["model"]),
                               "max_model_len": SHORT_AUDITOR_WINDOW}},
        "auditor": {"model": "tiny28k", "sampling": {"temperature": 1.0, "max_tokens": 160}},
    }))
    lhd("audit", str(run), "--mode", "full", "--auditor", str(short), "--auditor-id", "short-full", "--no-progress")
    over = jsonl(run / "audit" / "short-full" / "s7.jsonl")
    assert sorted(r["global_round"] for r in over) == list(range(1, 15))
    for r in over:
        assert r["parse_status"] == "failed" and r["deceptive"] is None
        assert f"exceeds the model's context of {SHORT_AUDITOR_WINDOW} tokens" in r["error"]
        assert not r.get("calls")  # refused before any request was sent


def test_training_data_and_a_grpo_step_keep_the_last_turn(long_run):
    from datasets import load_from_disk
    from transformers import AutoTokenizer

    run, root = long_run["run"], long_run["root"]
    data = root / "grpo-data"
    lhd("data", "grpo", str(run), "--out", str(data), "--eval-fraction", "0")
    ds = load_from_disk(str(data / "dataset"))["train"]
    assert len(ds) == 14
    tok = AutoTokenizer.from_pretrained(str(long_run["model"]))

    def n_tokens(messages: list[dict]) -> int:
        return len(tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                           return_dict=True)["input_ids"])

    lengths = [n_tokens(r["prompt"]) for r in ds]
    assert max(lengths) > 32768  # stored whole: the cut happens at training time, where it is recorded

    max_length, completion = 4096, 16
    adapters = root / "grpo-adapter"
    out = lhd("train", "grpo", "recipes/tiny/grpo-honest.yaml", f"model={long_run['model']}",
              f"data.train={data / 'dataset'}", f"output_dir={adapters}", "trainer.max_steps=1",
              f"trainer.max_completion_length={completion}", f"grpo.max_length={max_length}",
              "trainer.save_steps=1", "grpo.rewards=[{name: format_length}]")
    meta = json.loads((adapters / "adapter" / "lhd_adapter.json").read_text())
    info = meta["data"]["train"]
    fit = info["length_fit"]
    over = sum(n > max_length - completion for n in lengths)
    assert over > 0 and fit["truncated"] == over and fit["dropped"] == 0 and info["rows"] == 14
    assert "p50" in out and str(max_length) in out  # the length distribution is printed before training


def test_lens_read_fits_or_skips_each_long_call(long_run):
    out = long_run["root"] / "lens-read"
    max_length = 8192
    lhd("lens", "read", str(long_run["model"]), "--run", str(long_run["run"]), "--context", "full",
        "--max-length", str(max_length), "--token-fallback", "first-token", "--no-probe", "--bootstrap", "20",
        "--threads", "1", "--out", str(out), "--no-progress")
    summary = json.loads((out / "summary.json").read_text())
    read, skipped = summary["n_examples"], summary.get("skipped") or []
    assert read + len(skipped) == 14
    assert read > 0
    for s in skipped:
        assert "max_length" in s["reason"]
    # Each read call fits: the oldest middle messages of the long ones were left out, and each row says how many.
    import pandas as pd

    ex = pd.read_parquet(out / "examples.parquet")
    assert (ex["n_prompt_tokens"] <= max_length).all()
    assert (ex["dropped_messages"] > 0).any() and (ex["dropped_messages"] >= 0).all()
