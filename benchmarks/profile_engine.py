"""Where the rollout engine spends CPU time, mode by mode, on the same work as
`benchmarks/rollout_throughput.py` (its record pass, then sequential / engine / replay / flat).

Wall time on a shared machine says little; CPU time and call counts say more. For each mode this
prints the process's CPU seconds (user + system, every thread), the event-loop thread's own CPU
seconds (`time.thread_time` in the main thread: the engine, the benchmark's wrappers, tokenising
on submit), the backend's busy seconds and where they went (prefill / decode forwards / sampling),
the decode steps and batches, and the main thread's hottest functions under cProfile (the decode
worker threads are not profiled by cProfile; their CPU is the process CPU less the main thread's).

    python benchmarks/profile_engine.py --model PATH [--trials 4] [--tasks 1] [--top 25] [--json out.json]
        [--no-sequential]

Without --model a tiny random Llama is built in a temporary folder (its Python overhead is large
against its compute, so per-request and per-step costs stand out).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import rollout_throughput as rt  # noqa: E402


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


class Probe:
    """CPU, backend counters and a cProfile of the main thread around one mode."""

    def __init__(self, backend: Any, top: int):
        self.backend, self.top = backend, top
        self.modes: dict[str, dict[str, Any]] = {}

    def run(self, mode: str, fn: Any, *args: Any) -> Any:
        b = self.backend
        timings0, stats0, busy0 = dict(b.timings), dict(b.stats), b.busy_s
        prof = cProfile.Profile()
        cpu0, main0, wall0 = _cpu(), time.thread_time(), time.perf_counter()
        prof.enable()
        try:
            out = fn(*args)
        finally:
            prof.disable()
        wall, cpu, main = time.perf_counter() - wall0, _cpu() - cpu0, time.thread_time() - main0
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(self.top)
        self.modes[mode] = {
            "wall_s": round(wall, 2), "process_cpu_s": round(cpu, 2), "main_thread_cpu_s": round(main, 2),
            "backend_busy_s": round(b.busy_s - busy0, 2),
            "backend": {k: round(v - timings0.get(k, 0.0), 3) for k, v in b.timings.items()},
            "stats": {k: v - stats0.get(k, 0) for k, v in b.stats.items() if v - stats0.get(k, 0)},
            "profile": text.getvalue(),
        }
        m = self.modes[mode]
        print(f"== {mode}: wall {m['wall_s']} s, process CPU {m['process_cpu_s']} s, main thread CPU "
              f"{m['main_thread_cpu_s']} s, backend busy {m['backend_busy_s']} s {m['backend']}, {m['stats']}",
              flush=True)
        return out


def profile(model: Path, trials: int, tasks: int, top: int, tmp: Path, sequential: bool = True) -> dict[str, Any]:
    from rollouts.backends import build_backend, parse_spec

    spec = rt.spec_for("hf", model, trials, None)
    backend = build_backend(parse_spec(spec), name="m", log_dir=str(tmp / "logs"))
    probe = Probe(backend, top)
    import asyncio

    try:
        rec = rt.Recording(backend)
        probe.run("record", rt.run_engine, rec, rt.make_cfg(tmp / "hf", spec, "record", trials, tasks, trials))
        with rt.ignore_eos(backend):
            for mode, concurrency in ((("sequential", 1),) if sequential else ()) + (("engine", trials),):
                rt.reset_cache(backend)
                script = rt.Scripted(backend, rec)
                probe.run(mode, rt.run_engine, script, rt.make_cfg(tmp / "hf", spec, mode, trials, tasks, concurrency))
            for mode in ("replay", "flat"):
                rt.reset_cache(backend)
                probe.run(mode, rt.replay, backend, rec.calls, mode == "replay")
    finally:
        asyncio.run(backend.aclose())
    return probe.modes


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--trials", type=int, default=4)
    ap.add_argument("--tasks", type=int, default=1)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--no-sequential", action="store_true", help="skip the (slow) sequential mode")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from lhd_train.tiny_model import build_tiny_model

            model = build_tiny_model("llama", Path(tmp) / "tiny", seed=0)
        modes = profile(model, args.trials, args.tasks, args.top, Path(tmp), not args.no_sequential)
    for mode, m in modes.items():
        print(f"\n######## {mode}\n{m['profile']}")
    if args.json:
        args.json.write_text(json.dumps(modes, indent=2) + "\n")


if __name__ == "__main__":
    main()
