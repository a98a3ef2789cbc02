"""`lhd gpu-check [--device cuda|cuda:N|cpu] [--small]`: the paths most at risk on a GPU node
(issue 20), checked on one GPU without network and without vLLM in a few minutes (scripts/gpu_check.sh
wraps it; the command, in `cli/gpu_check.py`, prints). One line per check on stdout:

    CHECK <name>: PASS|FAIL|SKIP <detail>

and `PROJ <text>` lines projecting a measurement to the real model (Llama-3.1-8B).

Checks, in order (the module that holds each):
- `env` (here): torch and CUDA, the GPUs, bf16, a C compiler (Triton builds its launcher with one),
  bitsandbytes/triton/deepspeed presence, CUDA_VISIBLE_DEVICES;
- `tiny_model`, `hf_constrained_json`, `lens_fit_device_vs_cpu` (here): the random tiny Llama through
  the `hf` backend with JSON-constrained decoding, and a lens fit on the device against the CPU;
- `xgrammar_worker_thread` (here): xgrammar's CUDA bitmask kernel from a fresh thread (whose current
  device is 0) matches its CPU kernel; with two GPUs the `hf` backend on cuda:1 with JSON schemas;
- `hf_kv_memory`, `hf_oom_split`, `lens_8b_slice` (gpu_check_slice.py): an 8B-shaped 4-layer slice:
  the backend's peak memory against its own batch formula, a real out-of-memory error split and
  retried, the lens's peak and time against the lens planner, projected to 32 layers;
- `trl_lora_sft`, `trl_sft_long_rows`, `trl_dpo_lora`, `trl_qlora`, `train_single_device`
  (gpu_check_train.py): TRL through `lhd_train.finetune.trainer`.

`--device cpu` runs every check that has a CPU form (the test suite's smoke test) and SKIPs the
others with the reason; it hides any GPU (CUDA_VISIBLE_DEVICES="") before torch is imported.
`--small` shrinks the slice to a few MB (a CPU run of the slice checks). Exit status 0 when no
check FAILed."""
from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lhd_train.ops.gpu_check_base import STATUSES, Ctx, Outcome, gib, json_run, verdict

log = logging.getLogger(__name__)

PROMPTS = [
    "The quarterly report lists 21 units sold in region 3 at a price of 5.50 each, and demand was high.",
    "Our supervisor asked for the project timeline, the budget status and the open risks before Friday.",
    "The event planning team booked a venue for 120 people, ordered catering and prepared the schedule.",
    "Market analysis shows three competitors with lower prices but weaker customer support and slower delivery.",
    "The hackathon budget of 15000 dollars covers prizes, food, swag and two keynote speakers this year.",
    "Churn rose from four to seven percent after the price change, mostly among small business customers.",
]


def check_versions(ctx: Ctx) -> Outcome:
    """The installed versions against lhd's ranges (`version_ranges`): FAIL outside them."""
    import sys

    from lhd_train.ops.version_ranges import range_report

    rows = range_report()
    bad = [f"{n} {v} not in {spec}" for n, v, spec, ok in rows if v is not None and not ok]
    missing = [n for n, v, _, _ in rows if v is None]
    detail = f"Python {sys.version.split()[0]}; " + ", ".join(f"{n} {v}" for n, v, _, _ in rows if v)
    if missing:
        detail += f"; not installed: {', '.join(missing)}"
    if bad:
        detail += f"; OUTSIDE lhd's ranges (pyproject.toml): {'; '.join(bad)}"
    return verdict(not bad), detail


def check_env(ctx: Ctx) -> Outcome:
    import torch

    have = {m: importlib.util.find_spec(m) is not None
            for m in ("trl", "xgrammar", "datasets", "peft", "bitsandbytes", "triton", "deepspeed", "vllm")}
    cc = shutil.which(os.environ["CC"]) if os.environ.get("CC") else (shutil.which("cc") or shutil.which("gcc"))
    parts = [f"torch {torch.__version__} (CUDA build {torch.version.cuda})",
             "packages " + " ".join(f"{k}={'yes' if v else 'no'}" for k, v in have.items()),
             f"C compiler {cc or 'NONE'}", f"nvcc {shutil.which('nvcc') or 'none'}",
             f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}"]
    if not ctx.cuda:
        return "PASS", "device cpu; " + "; ".join(parts)
    if not torch.cuda.is_available():
        return "FAIL", "torch sees no GPU; " + "; ".join(parts)
    p = torch.cuda.get_device_properties(torch.device(ctx.device))
    bf16 = torch.cuda.is_bf16_supported()
    parts.insert(0, f"{torch.cuda.device_count()} GPU(s), {ctx.device}: {p.name} {gib(p.total_memory)} "
                    f"sm_{p.major}{p.minor} bf16 {'yes' if bf16 else 'NO'}")
    if have["triton"] and not cc:
        parts.append("no C compiler: xgrammar's Triton kernel cannot build, the hf backend uses its torch kernel")
    return verdict(bf16), "; ".join(parts)


def check_tiny_model(ctx: Ctx) -> Outcome:
    from lhd_train.tiny_model import build_tiny_model

    ctx.model_dir = build_tiny_model("llama", ctx.work / "tiny-llama", seed=0, num_layers=4)
    return verdict((ctx.model_dir / "config.json").is_file()), str(ctx.model_dir)


def check_hf_constrained(ctx: Ctx) -> Outcome:
    from rollouts.hf import HFBackend
    from rollouts.hf.spec import HFSpec

    assert ctx.model_dir is not None
    backend = HFBackend.from_spec(HFSpec(model=str(ctx.model_dir), device=ctx.device,
                                            dtype=ctx.dtype, max_batch_size=32, batch_wait_ms=20))
    n = 16 if ctx.small else 32
    bad, secs = json_run(backend, n, lambda i: [{"role": "user", "content": f"Audit answer {i}. Reply as JSON."}], 56)
    param = next(backend.model.parameters())
    detail = (f"{n - len(bad)}/{n} JSON answers valid on {param.device}/{str(param.dtype).removeprefix('torch.')} "
              f"in {secs:.1f} s ({backend.stats['batches']} batches, max {backend.stats['max_batch_rows']} rows, "
              f"bitmask kernel {backend.bitmask_kernel}, decode path {backend.decode_path})")
    if bad:
        detail += "; first problems: " + " | ".join(bad[:3])
    return verdict(not bad and (param.device.type == "cuda") == ctx.cuda and backend.decode_path.startswith("loop")), \
        detail


def check_xgrammar_thread(ctx: Ctx) -> Outcome:
    """M6: the Triton kernel launches on the thread's current device, which is 0 in a new thread."""
    if not ctx.cuda:
        return "SKIP", "needs CUDA (xgrammar's Triton kernel)"
    import torch
    import xgrammar as xgr

    from rollouts.hf import HFBackend
    from rollouts.hf.device import device_context
    from rollouts.hf.spec import HFSpec

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

    devices = ["cuda:0"] + (["cuda:1"] if ctx.gpus() >= 2 else [])
    for dev in devices:
        t = threading.Thread(target=work, args=(dev,))
        t.start()
        t.join()
    detail = "; ".join(f"Triton kernel on {d} from a worker thread: {got[d]}" for d in devices)
    ok = all(got[d] == "bit-exact" for d in devices)
    if len(devices) == 1:
        return verdict(ok), detail + "; hf backend on cuda:1 not checked (1 GPU)"
    assert ctx.model_dir is not None
    backend = HFBackend.from_spec(HFSpec(model=str(ctx.model_dir), device="cuda:1",
                                            dtype="bfloat16", max_batch_size=8, batch_wait_ms=20))
    bad, secs = json_run(backend, 8, lambda i: [{"role": "user", "content": f"Audit {i} as JSON."}], 56)
    where = next(backend.model.parameters()).device
    detail += (f"; hf backend on cuda:1 with JSON schemas: {8 - len(bad)}/8 valid on {where}, kernel "
               f"{backend.bitmask_kernel}" + (f" ({bad[0]})" if bad else ""))
    return verdict(ok and not bad and str(where) == "cuda:1"), detail


def check_lens(ctx: Ctx) -> Outcome:
    import torch

    from lens.fit import FitOptions, FitSettings, fit_lens
    from lens.model import load_hf

    assert ctx.model_dir is not None
    prompts = PROMPTS[:4] if ctx.small else PROMPTS
    options = FitOptions(checkpoint_every=0, resume=False, progress=False, min_prompts=1)

    def fit(device: str, dtype: str, dim_batch: int):
        m, tok = load_hf(str(ctx.model_dir), dtype=dtype, device=device, attn_implementation="eager")
        t0 = time.perf_counter()
        res = fit_lens(m, tok, prompts, FitSettings(skip_first=4, max_length=48, dim_batch=dim_batch), options=options)
        return res, time.perf_counter() - t0

    a, ta = fit(ctx.device, "float32", 32)
    b, tb = fit("cpu", "float32", 32 if ctx.cuda else 16)
    layers = a.lens.source_layers
    worst = max(float((a.lens.matrix(x).float().cpu() - b.lens.matrix(x).float().cpu()).abs().max()) for x in layers)
    scale = max(float(b.lens.matrix(x).abs().max()) for x in layers)
    tol = 1e-3 * max(1.0, scale)
    what = f"{ctx.device} vs cpu" if ctx.cuda else "cpu dim_batch 32 vs 16"
    detail = (f"{what}: max abs diff {worst:.2e} (tolerance {tol:.1e}) over {len(layers)} layers, "
              f"{a.report['n_prompts']} prompts; {ta:.1f} s vs {tb:.1f} s")
    finite = all(bool(torch.isfinite(a.lens.matrix(x)).all()) for x in layers)
    return verdict(finite and worst <= tol and a.report["n_prompts"] == len(prompts)), detail


def all_checks(everything: bool = False) -> list[tuple[str, Callable[[Ctx], Outcome]]]:
    """The checks in order. By default the set that fits a lent machine's lease (under 8 minutes on
    one H200, issue 30): the slice checks `hf_kv_memory`, `hf_oom_split` and `lens_8b_slice`, whose
    measurements the full-size 8B checks repeat at the real shape, run only with `everything`."""
    from lhd_train.ops import gpu_check_8b as big
    from lhd_train.ops import gpu_check_slice as slc
    from lhd_train.ops import gpu_check_train as trn

    slice_checks = [("hf_kv_memory", slc.check_hf_kv_memory), ("hf_oom_split", slc.check_hf_oom_split),
                    ("lens_8b_slice", slc.check_lens_slice)]
    return [
        ("versions", check_versions), ("env", check_env), ("tiny_model", check_tiny_model),
        ("hf_constrained_json", check_hf_constrained), ("xgrammar_worker_thread", check_xgrammar_thread),
        ("hf_decode_8b", big.check_hf_decode), ("hf_long_row_8b", big.check_long_row), ("train_8b", big.check_train),
        ("lens_8b", big.check_lens), ("lens_bf16_vs_fp32", big.check_lens_bf16),
        *(slice_checks if everything else []),
        ("trl_lora_sft", trn.check_trl_lora), ("trl_sft_long_rows", trn.check_sft_long_rows),
        ("trl_dpo_lora", trn.check_dpo_lora), ("trl_qlora", trn.check_qlora),
        ("train_single_device", trn.check_single_device), ("lens_fit_device_vs_cpu", check_lens),
    ]


PREREQUISITES = ("versions", "env", "tiny_model")


@dataclass
class CheckSummary:
    """What a run of the checks found: PASS/FAIL/SKIP counts, its seconds and its scratch folder."""

    counts: dict[str, int]
    seconds: float
    work: Path


def run_checks(device: str = "cuda", work: Path | None = None, only: set[str] | None = None, small: bool = False,
               on_result: Callable[[str, str, str], None] = lambda name, status, detail: None,
               everything: bool = False) -> CheckSummary:
    """Run the checks (`only` and the prerequisites, or all) and hand each outcome to `on_result`
    as it comes, so a caller killed by its timeout has shown every check that finished."""
    from lhd_train.errors import InputError

    for key, value in (("HF_HUB_OFFLINE", "1"), ("HF_HUB_DISABLE_TELEMETRY", "1"), ("TOKENIZERS_PARALLELISM", "false"),
                       ("WANDB_MODE", "disabled")):
        os.environ.setdefault(key, value)
    if device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch is imported
    checks = all_checks(everything or bool(only))
    names = [n for n, _ in checks]
    if only and only - set(names):
        raise InputError("command line", "--only", f"unknown check(s) {sorted(only - set(names))}", ", ".join(names))
    work = work or Path(tempfile.mkdtemp(prefix="lhd-gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    ctx = Ctx(device, work, small)
    counts = dict.fromkeys(STATUSES, 0)
    t_all = time.perf_counter()
    for name, fn in checks:
        if only and name not in only and name not in PREREQUISITES:
            continue
        t0 = time.perf_counter()
        try:
            status, detail = fn(ctx)
        except Exception as e:  # noqa: BLE001 - every check reports, none stops the others
            status, detail = "FAIL", f"{type(e).__name__}: {e}".replace("\n", " ")[:500]
            log.exception("check %s failed", name)
        on_result(name, status, f"{detail} [{time.perf_counter() - t0:.1f} s]")
        counts[status] += 1
        if name in PREREQUISITES and status == "FAIL":
            break
    return CheckSummary(counts, time.perf_counter() - t_all, work)
