"""Rollout throughput: the reference's way (one trial after another, one request at a time)
against our engine (all trials concurrently, requests batched), on the same fixed workload.

Workload: N trials x 14 tasks on the tiny random Llama, one round per task (so every trial has
exactly 14 rounds whatever the random supervisor says), fixed max_tokens. Also reports the
engine's overhead: the share of its wall time not spent inside the backend's batched decodes.
Each mode runs with the `hf` backend's prefix cache on and off (`--prefix-cache both`, the
default): the reference itself recomputes every prompt, a vLLM server it talks to would not.

    python benchmarks/rollout_throughput.py [--trials 8] [--model DIR] [--prefix-cache on|off|both]
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


def make_cfg(out: Path, model: Path, name: str, trials: int, concurrency: int, batch: int, cache: bool = True):
    sampling = lambda n: {"temperature": 1.0, "top_p": 0.95, "max_tokens": n}  # noqa: E731
    return parse_config({
        "run_name": name, "output_dir": str(out), "seeds": list(range(1000, 1000 + trials)),
        "max_rounds_per_task": 1, "concurrency": concurrency,
        "models": {"tiny": {"backend": "hf", "model": str(model), "max_batch_size": batch, "batch_wait_ms": 2,
                            "enable_prefix_caching": cache}},
        "performer": {"model": "tiny", "sampling": sampling(32)},
        "supervisor": {"model": "tiny", "sampling": sampling(96)},
        "summariser": {"model": "tiny", "sampling": sampling(16)},
    }, "benchmark")


def timed_run(cfg) -> dict:
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
    return {"wall": wall, "busy": b.busy_s, "rounds": sum(r.rounds for r in results), "requests": b.stats["rows"],
            "prefill": b.stats["prefill_tokens"], "reused": b.stats["prefix_reused_tokens"],
            "steps": b.stats["decode_steps"], **{k: round(v, 1) for k, v in b.timings.items()}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=8)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--prefix-cache", choices=["on", "off", "both"], default="both")
    args = ap.parse_args()
    import torch

    caches = {"on": [True], "off": [False], "both": [False, True]}[args.prefix_cache]
    runs: dict[tuple[str, bool], dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = args.model or build_tiny_model("llama", tmp / "model", seed=0)
        # Warm-up (model load, grammar compile caches are per backend; this loads the OS caches).
        timed_run(make_cfg(tmp, model, "warmup", 1, 1, 1))
        for cache in caches:
            tag = "cache" if cache else "nocache"
            runs["sequential", cache] = timed_run(make_cfg(tmp, model, f"sequential-{tag}", args.trials, 1, 1, cache))
            runs["engine", cache] = timed_run(
                make_cfg(tmp, model, f"engine-{tag}", args.trials, args.trials, 4 * args.trials, cache))
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"workload: {args.trials} trials x 14 tasks x 1 round, tiny llama (hidden 64, 2 layers)")
    print(f"{'mode':<12}{'prefix cache':>13}{'rounds':>8}{'requests':>10}{'prefilled tok':>15}{'reused tok':>12}"
          f"{'decode steps':>14}{'wall s':>9}{'backend busy s':>16}")
    for (mode, cache), r in runs.items():
        print(f"{mode:<12}{'on' if cache else 'off':>13}{r['rounds']:>8}{r['requests']:>10}{r['prefill']:>15}"
              f"{r['reused']:>12}{r['steps']:>14}{r['wall']:>9.1f}{r['busy']:>16.1f}")
    for cache in caches:
        seq, eng = runs["sequential", cache], runs["engine", cache]
        print(f"prefix cache {'on ' if cache else 'off'}: speed-up (sequential wall / engine wall) "
              f"{seq['wall'] / eng['wall']:.2f}x; engine overhead (wall outside batched decodes / wall) "
              f"{(eng['wall'] - eng['busy']) / eng['wall']:.1%}")
    print("inside the backend (s):", {f"{m}/{'cache' if c else 'nocache'}": {k: r[k] for k in ("prefill_s", "forward_s", "sample_s")}
                                       for (m, c), r in runs.items()})
    if len(caches) == 2:
        print(f"engine with the cache / the reference's way (sequential, no cache): "
              f"{runs['sequential', False]['wall'] / runs['engine', True]['wall']:.2f}x")


if __name__ == "__main__":
    main()
