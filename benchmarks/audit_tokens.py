"""Prompt tokens one auditor pass needs per trial (14, 28 and 42 rounds), for our layout
[instructions][full trajectory][target round] with and without a prefix cache, against the
reference layout [target round][full trajectory], which defeats prefix caching.

Counts are analytic: the real prompt builder (lhd_train.audit) renders every round's prompt of a
trajectory played by a scripted performer whose answers have a fixed length; tokens are counted
with a tokenizer (`--tokenizer DIR`) or estimated as characters / 4 (the estimate docs/reference.md uses).

    python benchmarks/audit_tokens.py [--answer-chars 6000] [--tokenizer DIR]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from support.scripted import ScriptedBackend  # noqa: E402

from lhd_train.audit.trajectory import AuditorPrompts, build_messages, load_task_texts, load_trial  # noqa: E402
from lhd_train.bench.events import draw_schedule  # noqa: E402
from lhd_train.bench.prompts import Prompts  # noqa: E402
from lhd_train.bench.taskpack import load_pack  # noqa: E402
from lhd_train.bench.trial import RunContext, run_trial  # noqa: E402
from lhd_train.config.auditor import RenderOptions  # noqa: E402
from lhd_train.config.run import parse_config  # noqa: E402
from lhd_train.rundir.run import Run  # noqa: E402


def play(out: Path, rounds_per_task: int, answer_chars: int) -> Path:
    """A 14-task trial where every task takes exactly `rounds_per_task` rounds."""
    cfg = parse_config({"run_name": f"r{rounds_per_task}", "output_dir": str(out), "seeds": [390185437],
                        "models": {"m": {"backend": "hf", "model": "unused"}},
                        "performer": {"model": "m"}, "supervisor": {"model": "m"}}, "benchmark")
    evals = {"n": 0}
    filler = ("The market sizing in market_overview.md row 3 supports a conservative estimate. " * 200)[:answer_chars]

    def reply(req):
        props = (req.json_schema or {}).get("properties", {})
        if "trust" in props:
            evals["n"] += 1
            done = evals["n"] % rounds_per_task == 0
            return json.dumps({"reasoning": "Evaluation. " * 120, "trust": 0.1, "satisfaction": 0.5 if done else 0.1,
                               "comfort": 0.0})
        if "feedback" in props:
            return json.dumps({"reasoning": "Plan. " * 100, "feedback": "Please revise the numbers. " * 45})
        if "private notes" in req.messages[0]["content"]:
            return "Summary note. " * 40
        return filler

    pack = load_pack(cfg.task_pack)
    (cfg.run_dir / "trials").mkdir(parents=True)
    b = ScriptedBackend(reply)
    ctx = RunContext(cfg, cfg.run_name, cfg.run_dir, pack, Prompts(),
                     {"performer": b, "supervisor": b, "summariser": b}, {})
    asyncio.run(run_trial(ctx, "s390185437", 390185437, draw_schedule(pack, 390185437)))
    (cfg.run_dir / "config.resolved.yaml").write_text(f"task_pack: {cfg.task_pack}\n")
    return cfg.run_dir


def common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--answer-chars", type=int, default=6000)
    ap.add_argument("--tokenizer", type=Path, default=None)
    args = ap.parse_args()
    if args.tokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.tokenizer)
        count = lambda s: len(tok(s, add_special_tokens=False)["input_ids"])  # noqa: E731
        unit = f"tokens ({args.tokenizer.name} tokenizer)"
    else:
        count = lambda s: len(s) // 4  # noqa: E731
        unit = "tokens (chars/4 estimate)"
    prompts = AuditorPrompts.load()
    print(f"auditor prompt tokens per trial, performer answers of {args.answer_chars} chars; {unit}")
    print(f"{'rounds':>6} {'per call':>10} {'ours, no cache':>15} {'ours, prefix cache':>19} "
          f"{'reference layout':>17} {'saving':>7}")
    with tempfile.TemporaryDirectory() as tmp:
        for rpt in (1, 2, 3):
            run_dir = play(Path(tmp), rpt, args.answer_chars)
            tasks, _ = load_task_texts(run_dir, "startup_consulting")
            trial = load_trial(Run.open(run_dir), "s390185437", tasks)
            ours, ref = [], []
            for i in range(len(trial.rows)):
                msgs, _ = build_messages(trial, i, "full", 6, RenderOptions(), prompts)
                text = msgs[0]["content"] + "\n" + msgs[1]["content"]
                ours.append(text)
                user = msgs[1]["content"]
                target_at = user.index("=== ROUND TO JUDGE")
                # The reference put the target section first, then the whole history.
                ref.append(msgs[0]["content"] + "\n" + user[target_at:] + "\n" + user[:target_at])
            total = sum(count(t) for t in ours)
            shared = min(common_prefix(ours[0], t) for t in ours[1:])
            cached = count(ours[0][:shared]) + sum(count(t[shared:]) for t in ours)
            ref_shared = min(common_prefix(ref[0], t) for t in ref[1:])  # the system prompt only
            ref_cached = count(ref[0][:ref_shared]) + sum(count(t[ref_shared:]) for t in ref)
            print(f"{len(ours):>6} {count(ours[-1]):>10,} {total:>15,} {cached:>19,} {ref_cached:>17,} "
                  f"{1 - cached / ref_cached:>7.0%}")


if __name__ == "__main__":
    main()
