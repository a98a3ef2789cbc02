"""Rollout throughput: the reference's way (one trial after another, one request at a time)
against our engine (all trials concurrently, requests batched), on the same fixed workload.

Workload: N trials x 14 tasks on the tiny random Llama, one round per task (so every trial has
exactly 14 rounds whatever the random supervisor says), fixed max_tokens. Also reports the
engine's overhead: the share of its wall time not spent inside the backend's batched decodes.

    python benchmarks/rollout_throughput.py [--trials 8] [--model DIR]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lhd_train.engine as engine  # noqa: E402
from lhd_train.config import parse_config  # noqa: E402
from lhd_train.tiny_model import build_tiny_model  # noqa: E402


def make_cfg(out: Path, model: Path, name: str, trials: int, concurrency: int, batch: int):
    sampling = lambda n: {"temperature": 1.0, "top_p": 0.95, "max_tokens": n}  # noqa: E731
    return parse_config({
        "run_name": name, "output_dir": str(out), "seeds": list(range(1000, 1000 + trials)),
        "max_rounds_per_task": 1, "concurrency": concurrency,
        "models": {"tiny": {"backend": "hf", "model": str(model), "max_batch_size": batch, "batch_wait_ms": 2}},
        "performer": {"model": "tiny", "sampling": sampling(32)},
        "supervisor": {"model": "tiny", "sampling": sampling(96)},
        "summariser": {"model": "tiny", "sampling": sampling(16)},
    }, "benchmark")


def timed_run(cfg) -> tuple[float, float, int, int]:
    built = []
    real = engine.build_backend

    def capture(spec, name="", log_dir=None):
        b = real(spec, name=name, log_dir=log_dir)
        built.append(b)
        return b

    engine.build_backend = capture
    try:
        t0 = time.perf_counter()
        results = asyncio.run(engine.run_benchmark(cfg, progress=False))
        wall = time.perf_counter() - t0
    finally:
        engine.build_backend = real
    b = built[0]
    assert all(r.status == "done" for r in results), [r.error for r in results]
    return wall, b.busy_s, sum(r.rounds for r in results), b.stats["rows"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=8)
    ap.add_argument("--model", type=Path, default=None)
    args = ap.parse_args()
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = args.model or build_tiny_model("llama", tmp / "model", seed=0)
        # Warm-up (model load, grammar compile caches are per backend; this loads the OS caches).
        timed_run(make_cfg(tmp, model, "warmup", 1, 1, 1))
        seq_wall, seq_busy, seq_rounds, seq_req = timed_run(make_cfg(tmp, model, "sequential", args.trials, 1, 1))
        eng_wall, eng_busy, eng_rounds, eng_req = timed_run(
            make_cfg(tmp, model, "engine", args.trials, args.trials, 4 * args.trials))
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"workload: {args.trials} trials x 14 tasks x 1 round, tiny llama (hidden 64, 2 layers)")
    print(f"{'mode':<12}{'rounds':>8}{'requests':>10}{'wall s':>9}{'rounds/s':>10}{'backend busy s':>16}")
    print(f"{'sequential':<12}{seq_rounds:>8}{seq_req:>10}{seq_wall:>9.1f}{seq_rounds / seq_wall:>10.2f}{seq_busy:>16.1f}")
    print(f"{'engine':<12}{eng_rounds:>8}{eng_req:>10}{eng_wall:>9.1f}{eng_rounds / eng_wall:>10.2f}{eng_busy:>16.1f}")
    print(f"speed-up (sequential wall / engine wall): {seq_wall / eng_wall:.2f}x")
    print(f"engine overhead (wall outside batched decodes / wall): {(eng_wall - eng_busy) / eng_wall:.1%}")


if __name__ == "__main__":
    main()
