"""The device's software and the tiny model on it: lhd's version ranges, torch/CUDA/bf16 and a C
compiler, the hf backend with JSON-constrained decoding, xgrammar's Triton kernel from a worker
thread, and a lens fit and a tuned-lens training on the device against the CPU."""
from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import threading
import time
from typing import Any

from gpu_support import declared_ranges, gib, hf_backend, is_cuda, json_run, range_report

PROMPTS = [
    "The quarterly report lists 21 units sold in region 3 at a price of 5.50 each, and demand was high.",
    "Our supervisor asked for the project timeline, the budget status and the open risks before Friday.",
    "The event planning team booked a venue for 120 people, ordered catering and prepared the schedule.",
    "Market analysis shows three competitors with lower prices but weaker customer support and slower delivery.",
    "The hackathon budget of 15000 dollars covers prizes, food, swag and two keynote speakers this year.",
    "Churn rose from four to seven percent after the price change, mostly among small business customers.",
]


def version_problems(ranges: dict[str, str]) -> tuple[list[str], str]:
    """(installed versions outside `ranges`, a line naming every version)."""
    rows = range_report(ranges)
    bad = [f"{n} {v} not in {spec}" for n, v, spec, ok in rows if v is not None and not ok]
    missing = [n for n, v, _, _ in rows if v is None]
    line = f"Python {sys.version.split()[0]}; " + ", ".join(f"{n} {v}" for n, v, _, _ in rows if v)
    return bad, line + (f"; not installed: {', '.join(missing)}" if missing else "")


def test_versions(device, measure):
    """Run first on a node: a version outside lhd's ranges is what to fix before reading anything else."""
    bad, line = version_problems(declared_ranges())
    measure(line)
    assert not bad, f"OUTSIDE lhd's ranges (pyproject.toml): {'; '.join(bad)}"


def test_a_version_outside_the_ranges_is_named():
    """The check above can fail: a torch range the installed torch is not in."""
    import importlib.metadata as md

    ranges = declared_ranges()
    assert ranges["torch"] == "<2.14,>=2.11" and ranges["transformers"] == "<5.25,>=5.17"
    assert version_problems(ranges)[0] == []
    bad, _ = version_problems({**ranges, "torch": ">=2.14,<2.15"})
    assert bad == [f"torch {md.version('torch')} not in >=2.14,<2.15"]


def test_env(device, measure):
    import torch

    have = {m: importlib.util.find_spec(m) is not None
            for m in ("trl", "xgrammar", "datasets", "peft", "bitsandbytes", "triton", "deepspeed", "vllm")}
    cc = shutil.which(os.environ["CC"]) if os.environ.get("CC") else (shutil.which("cc") or shutil.which("gcc"))
    parts = [f"torch {torch.__version__} (CUDA build {torch.version.cuda})",
             "packages " + " ".join(f"{k}={'yes' if v else 'no'}" for k, v in have.items()),
             f"C compiler {cc or 'NONE'}", f"nvcc {shutil.which('nvcc') or 'none'}",
             f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}"]
    if not is_cuda(device):
        measure("device cpu; " + "; ".join(parts))
        return
    p = torch.cuda.get_device_properties(torch.device(device))
    bf16 = torch.cuda.is_bf16_supported()
    parts.insert(0, f"{torch.cuda.device_count()} GPU(s), {device}: {p.name} {gib(p.total_memory)} "
                    f"sm_{p.major}{p.minor} bf16 {'yes' if bf16 else 'NO'}")
    if have["triton"] and not cc:
        parts.append("no C compiler: xgrammar's Triton kernel cannot build, the hf backend uses its torch kernel")
    measure("; ".join(parts))
    assert bf16, "the GPU has no bf16"


def test_hf_constrained_json(device, tiny4_dir, measure):
    """Batched JSON-schema decoding on the device through lhd's own decode loop."""
    backend = hf_backend(tiny4_dir, device, max_batch_size=32, batch_wait_ms=20)
    n = 32 if is_cuda(device) else 16
    bad, secs = json_run(backend, n, lambda i: [{"role": "user", "content": f"Audit answer {i}. Reply as JSON."}], 56)
    param = next(backend.model.parameters())
    measure(f"{n - len(bad)}/{n} JSON answers valid on {param.device}/{str(param.dtype).removeprefix('torch.')} "
            f"in {secs:.1f} s ({backend.stats['batches']} batches, max {backend.stats['max_batch_rows']} rows, "
            f"bitmask kernel {backend.bitmask_kernel}, decode path {backend.decode_path})")
    assert not bad, " | ".join(bad[:3])
    assert param.device.type == ("cuda" if is_cuda(device) else "cpu")
    assert backend.decode_path.startswith("loop")


def test_xgrammar_worker_thread(cuda, tiny4_dir, measure):
    """The Triton kernel launches on the thread's current device, which is 0 in a new thread; with two
    GPUs the hf backend on cuda:1 decodes JSON schemas."""
    import torch
    import xgrammar as xgr

    from rollouts.hf.device import device_context

    vocab = 128256
    g = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (4, (vocab + 31) // 32), dtype=torch.int32, generator=g)
    logits = torch.randn(4, vocab, generator=g)
    ref = logits.clone()
    xgr.apply_token_bitmask_inplace(ref, bitmask, vocab_size=vocab, indices=[0, 2])
    got: dict[str, Any] = {}

    def work(dev: str) -> None:
        try:
            with device_context(dev):
                lg = logits.to(dev)
                xgr.apply_token_bitmask_inplace(lg, bitmask.to(dev), vocab_size=vocab, indices=[0, 2],
                                                backend="triton")
                torch.cuda.synchronize(dev)
            got[dev] = "bit-exact" if torch.equal(lg.cpu(), ref) else "DIFFERS from the CPU kernel"
        except Exception as e:  # noqa: BLE001 - reported
            got[dev] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"

    devices = ["cuda:0"] + (["cuda:1"] if torch.cuda.device_count() >= 2 else [])
    for dev in devices:
        t = threading.Thread(target=work, args=(dev,))
        t.start()
        t.join()
    measure("; ".join(f"Triton kernel on {d} from a worker thread: {got[d]}" for d in devices))
    assert all(got[d] == "bit-exact" for d in devices), got
    if len(devices) == 1:
        measure("hf backend on cuda:1 not checked (1 GPU)")
        return
    backend = hf_backend(tiny4_dir, "cuda:1", max_batch_size=8, batch_wait_ms=20)
    bad, _ = json_run(backend, 8, lambda i: [{"role": "user", "content": f"Audit {i} as JSON."}], 56)
    where = next(backend.model.parameters()).device
    measure(f"hf backend on cuda:1 with JSON schemas: {8 - len(bad)}/8 valid on {where}, kernel "
            f"{backend.bitmask_kernel}" + (f" ({bad[0]})" if bad else ""))
    assert not bad and str(where) == "cuda:1"


def test_lens_fit_device_vs_cpu(device, tiny4_dir, measure):
    """The lens fitted on the device equals the CPU fit (on CPU: dim_batch 32 against 16)."""
    import torch

    from lens.fit import FitOptions, FitSettings, fit_lens
    from lens.model import load_hf

    prompts = PROMPTS if is_cuda(device) else PROMPTS[:4]
    options = FitOptions(checkpoint_every=0, resume=False, progress=False, min_prompts=1)

    def fit(where: str, dim_batch: int):
        m, tok = load_hf(str(tiny4_dir), dtype="float32", device=where, attn_implementation="eager")
        t0 = time.perf_counter()
        res = fit_lens(m, tok, prompts, FitSettings(skip_first=4, max_length=48, dim_batch=dim_batch), options=options)
        return res, time.perf_counter() - t0

    a, ta = fit(device, 32)
    b, tb = fit("cpu", 32 if is_cuda(device) else 16)
    layers = a.lens.source_layers
    worst = max(float((a.lens.matrix(x).float().cpu() - b.lens.matrix(x).float().cpu()).abs().max()) for x in layers)
    tol = 1e-3 * max(1.0, max(float(b.lens.matrix(x).abs().max()) for x in layers))
    what = f"{device} vs cpu" if is_cuda(device) else "cpu dim_batch 32 vs 16"
    measure(f"{what}: max abs diff {worst:.2e} (tolerance {tol:.1e}) over {len(layers)} layers, "
            f"{a.report['n_prompts']} prompts; {ta:.1f} s vs {tb:.1f} s")
    assert all(bool(torch.isfinite(a.lens.matrix(x)).all()) for x in layers)
    assert worst <= tol and a.report["n_prompts"] == len(prompts)


def test_tuned_lens_device_vs_cpu(device, tiny4_dir, measure):
    """A tuned lens trained on the device (translators and Adam there, the captured states on the host) ends
    where the CPU training ends (translators within 1 %), with its training KL cut at every layer. (The random
    tiny model's next-token distribution is nearly flat, so its held-back KL says little: it is reported.)"""
    import torch

    from lens.model import load_hf
    from lens.tuned import TuneSettings, fit_tuned_lens

    settings = TuneSettings(layers=[0, 1, 2], max_length=48, skip_first=4, steps=60, batch_tokens=64, lr=1e-2,
                            val_prompts=2, progress=False)

    def train(where: str):
        m, tok = load_hf(str(tiny4_dir), dtype="float32", device=where, attn_implementation="eager")
        t0 = time.perf_counter()
        lens = fit_tuned_lens(m, tok, PROMPTS, settings)
        return lens, time.perf_counter() - t0

    a, ta = train(device)
    b, tb = train("cpu")
    worst = max(float((a.A[k] - b.A[k]).norm() / b.A[k].norm()) for k in b.layers)
    first, last = a.meta.training["history"][0], a.meta.training["history"][-1]
    measure(f"{device} vs cpu: translators differ by {worst:.1e} (relative); training KL at layer 0 "
            f"{first['0']:.4f} -> {last['0']:.4f}; held-back KL {a.meta.kl_val_before['0']:.4f} -> "
            f"{a.meta.kl_val_after['0']:.4f}; {ta:.1f} s vs {tb:.1f} s")
    assert all(a.A[k].device.type == "cpu" and bool(torch.isfinite(a.A[k]).all()) for k in a.layers)  # on the host
    assert all(last[str(k)] < 0.5 * first[str(k)] for k in a.layers)
    assert worst <= 1e-2
