"""The whole pipeline on a random tiny model, on CPU: build the model, run the benchmark.

Every step is resumable: running the demo again skips what is already on disk."""
from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
os.chdir(ROOT)


def step(title: str) -> None:
    print(f"\n== {title} ==", flush=True)


def main() -> int:
    from lhd_train.cli import print_summary
    from lhd_train.config import load_config
    from lhd_train.engine import run_benchmark
    from lhd_train.tiny_model import build_tiny_model

    t0 = time.time()
    model_dir = ROOT / "runs" / "tiny-llama"
    if not (model_dir / "config.json").exists():
        step("building a tiny random Llama and its tokenizer")
        build_tiny_model("llama", model_dir, seed=0)
    cfg = load_config(ROOT / "configs" / "demo.yaml")
    step(f"running the benchmark: {len(cfg.trial_seeds())} trials x 14 tasks")
    results = asyncio.run(run_benchmark(cfg))
    print_summary(results)
    if any(r.status != "done" for r in results):
        print("some trials failed; run `make demo` again to resume", file=sys.stderr)
        return 1
    print(f"\ndone in {time.time() - t0:.0f}s")
    print(f"trajectories: {cfg.run_dir / 'trials'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
