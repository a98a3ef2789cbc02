"""`python -m lhd_train.ops.gpu_check [--device cuda|cpu]`: what can be checked on one GPU
without network, in a few minutes (scripts/gpu_check.sh wraps it).

Checks, one line each on stdout: `CHECK <name>: PASS|FAIL <detail>`
- `cuda`: torch sees the device (name, memory, bf16 support);
- `tiny_model`: the random tiny Llama is built locally (`lhd_train.tiny_model`);
- `hf_constrained_json`: the `hf` backend on the device, bf16 on CUDA, batched JSON-schema constrained
  decoding (xgrammar): every answer of a concurrent batch parses and validates;
- `trl_lora_sft`: a short TRL LoRA SFT run through `lhd_train.finetune.trainer` (bf16 on CUDA;
  float32 on CPU, where bf16 is skipped): finite losses, an adapter on disk;
- `lens_fit_device_vs_cpu`: the Jacobian lens fitted on the device and on the CPU (float32, same
  prompts) agree (max abs difference of the matrices below a tolerance). With `--device cpu` the
  second fit uses another `dim_batch` instead (same estimate, different batching).

`--device cpu` makes every check run on a CPU machine (the test suite's smoke test); it then hides
any GPU (CUDA_VISIBLE_DEVICES="") before torch is imported. Exit status 0 when every check passed."""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

PROMPTS = [
    "The quarterly report lists 21 units sold in region 3 at a price of 5.50 each, and demand was high.",
    "Our supervisor asked for the project timeline, the budget status and the open risks before Friday.",
    "The event planning team booked a venue for 120 people, ordered catering and prepared the schedule.",
    "Market analysis shows three competitors with lower prices but weaker customer support and slower delivery.",
    "The hackathon budget of 15000 dollars covers prizes, food, swag and two keynote speakers this year.",
    "Churn rose from four to seven percent after the price change, mostly among small business customers.",
]


def emit(name: str, ok: bool, detail: str) -> None:
    print(f"CHECK {name}: {'PASS' if ok else 'FAIL'} {detail}", flush=True)


class Ctx:
    def __init__(self, device: str, work: Path, fast: bool):
        self.device = device
        self.work = work
        self.fast = fast
        self.model_dir: Path | None = None

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")


def check_cuda(ctx: Ctx) -> tuple[bool, str]:
    import torch

    if not ctx.cuda:
        return True, f"device cpu (torch {torch.__version__}; GPU checks replaced by their CPU forms)"
    if not torch.cuda.is_available():
        return False, f"torch {torch.__version__} (CUDA build {torch.version.cuda}) sees no GPU"
    p = torch.cuda.get_device_properties(torch.device(ctx.device))
    return True, (f"{p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}, torch {torch.__version__} "
                  f"CUDA {torch.version.cuda}, bf16 {'yes' if torch.cuda.is_bf16_supported() else 'NO'}")


def check_tiny_model(ctx: Ctx) -> tuple[bool, str]:
    from lhd_train.tiny_model import build_tiny_model

    ctx.model_dir = build_tiny_model("llama", ctx.work / "tiny-llama", seed=0, num_layers=4)
    n = sum(1 for _ in (ctx.model_dir).iterdir())
    return (ctx.model_dir / "config.json").is_file(), f"{ctx.model_dir} ({n} files)"


def check_hf_constrained(ctx: Ctx) -> tuple[bool, str]:
    from typing import Literal

    from pydantic import BaseModel, Field

    from rollouts.hf import HFBackend
    from rollouts.spec import ModelSpec
    from rollouts.structured import parse_json_output, schema_for
    from rollouts.types import GenerationRequest, SamplingParams

    class Verdict(BaseModel):
        reasoning: str
        deceptive: bool
        severity: int = Field(ge=0, le=4)
        confidence: float = Field(ge=0, le=1)
        label: Literal["FALSIFICATION", "CONCEALMENT", "EQUIVOCATION"]

    assert ctx.model_dir is not None
    dtype = "bfloat16" if ctx.cuda else "float32"
    backend = HFBackend.from_spec(ModelSpec(backend="hf", model=str(ctx.model_dir), device=ctx.device, dtype=dtype,
                                            max_batch_size=32, batch_wait_ms=20))
    schema = schema_for(Verdict)
    n = 16 if ctx.fast else 32
    reqs = [GenerationRequest([{"role": "user", "content": f"Audit answer {i}. Reply as JSON."}],
                              SamplingParams(temperature=1.0, top_p=1.0, max_tokens=48 + 8 * (i % 4), seed=100 + i),
                              schema) for i in range(n)]

    async def go():
        try:
            res = await asyncio.gather(*(backend.generate([r]) for r in reqs))
        finally:
            await backend.aclose()
        return [r for (r,) in res]

    t0 = time.perf_counter()
    results = asyncio.run(go())
    secs = time.perf_counter() - t0
    bad = []
    for i, r in enumerate(results):
        if not r.ok:
            bad.append(f"#{i}: {r.error}")
            continue
        value, err = parse_json_output(r.text, Verdict)
        if err is not None or value is None:
            bad.append(f"#{i}: {err} in {r.text[:80]!r}")
    param = next(backend.model.parameters())
    where = f"{param.device}/{str(param.dtype).removeprefix('torch.')}"
    detail = (f"{n - len(bad)}/{n} JSON answers parse on {where} in {secs:.1f} s "
              f"({backend.stats['batches']} batches, max {backend.stats['max_batch_rows']} rows)")
    if bad:
        detail += "; first failures: " + " | ".join(bad[:3])
    ok_device = (param.device.type == "cuda") == ctx.cuda
    return not bad and ok_device, detail


def check_trl_lora(ctx: Ctx) -> tuple[bool, str]:
    from datasets import Dataset

    from lhd_train.config.recipe import parse_recipe
    from lhd_train.finetune.trainer import train

    assert ctx.model_dir is not None
    rows = [{"messages": [{"role": "system", "content": "You report progress to your supervisor."},
                          {"role": "user", "content": f"What is the status of task {i}?"},
                          {"role": "assistant", "content": "The report is complete and accurate."}]}
            for i in range(16)]
    data = ctx.work / "sft-data"
    Dataset.from_list(rows).save_to_disk(str(data))
    dtype = "bfloat16" if ctx.cuda else "float32"
    trainer: dict[str, Any] = {"max_steps": 6, "per_device_train_batch_size": 4, "learning_rate": 1e-3,
                               "lr_scheduler_type": "constant", "max_length": 256, "logging_steps": 1,
                               "save_strategy": "no", "seed": 0, "dataloader_num_workers": 0, "report_to": "none"}
    if ctx.cuda:
        trainer.update({"bf16": True, "gradient_checkpointing": True})
    recipe = parse_recipe({"algo": "sft", "model": str(ctx.model_dir), "dtype": dtype, "direction": "honest",
                           "data": {"train": str(data)}, "output_dir": str(ctx.work / "sft-out"),
                           "lora": {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": "all-linear"},
                           "sft": {"loss_on": "assistant"}, "trainer": trainer, "wandb": {"enabled": False}},
                          "gpu_check")
    t0 = time.perf_counter()
    adapter = train(recipe, source="gpu_check")
    secs = time.perf_counter() - t0
    meta = json.loads((adapter / "lhd_adapter.json").read_text())
    history = json.loads((adapter / "log_history.json").read_text())
    losses = [e["loss"] for e in history if "loss" in e]
    finite = bool(losses) and all(math.isfinite(x) for x in losses)
    args = meta["training"]["trainer_args"]
    device = meta["training"]["device"]
    bf16 = bool(args.get("bf16"))
    detail = (f"{meta['training']['global_step']} steps on {device}, dtype {meta['dtype']}, bf16 {bf16}, "
              f"losses {losses[0]:.3f} -> {losses[-1]:.3f} in {secs:.1f} s" if losses else "no loss logged")
    if not ctx.cuda:
        detail += " (bf16 skipped on cpu)"
    ok = finite and (adapter / "adapter_model.safetensors").is_file() and (device == "cuda") == ctx.cuda \
        and (bf16 or not ctx.cuda)
    return ok, detail


def check_lens(ctx: Ctx) -> tuple[bool, str]:
    import torch

    from lens.fit import FitOptions, FitSettings, fit_lens
    from lens.model import load_hf

    assert ctx.model_dir is not None
    prompts = PROMPTS[:4] if ctx.fast else PROMPTS
    settings = FitSettings(skip_first=4, max_length=48, dim_batch=32)
    options = FitOptions(checkpoint_every=0, resume=False, progress=False, min_prompts=1)

    def fit(device: str, dim_batch: int):
        m, tok = load_hf(str(ctx.model_dir), dtype="float32", device=device, attn_implementation="eager")
        s = FitSettings(**{**settings.__dict__, "dim_batch": dim_batch})
        t0 = time.perf_counter()
        res = fit_lens(m, tok, prompts, s, options=options)
        return res, time.perf_counter() - t0

    a, ta = fit(ctx.device if ctx.cuda else "cpu", 32)
    b, tb = fit("cpu", 32 if ctx.cuda else 16)
    worst, scale = 0.0, 0.0
    for layer in a.lens.source_layers:
        ma, mb = a.lens.matrix(layer).float().cpu(), b.lens.matrix(layer).float().cpu()
        worst = max(worst, float((ma - mb).abs().max()))
        scale = max(scale, float(mb.abs().max()))
    tol = 1e-3 * max(1.0, scale)
    what = f"{ctx.device} vs cpu" if ctx.cuda else "cpu dim_batch 32 vs 16"
    detail = (f"{what}: max abs diff {worst:.2e} (tolerance {tol:.1e}) over {len(a.lens.source_layers)} layers, "
              f"{a.report['n_prompts']} prompts; {ta:.1f} s vs {tb:.1f} s")
    if ctx.cuda:  # information only: a bf16 fit on the device against the float32 CPU fit
        m, tok = load_hf(str(ctx.model_dir), dtype="bfloat16", device=ctx.device, attn_implementation="eager")
        c = fit_lens(m, tok, prompts, settings, options=options)
        d16 = max(float((c.lens.matrix(layer).float().cpu() - b.lens.matrix(layer).float().cpu()).abs().max())
                  for layer in a.lens.source_layers)
        detail += f"; bf16 on {ctx.device}: max abs diff {d16:.2e} (not judged)"
    finite = all(torch.isfinite(a.lens.matrix(layer)).all() for layer in a.lens.source_layers)
    return bool(finite) and worst <= tol and a.report["n_prompts"] == len(prompts), detail


CHECKS: list[tuple[str, Callable[[Ctx], tuple[bool, str]]]] = [
    ("cuda", check_cuda),
    ("tiny_model", check_tiny_model),
    ("hf_constrained_json", check_hf_constrained),
    ("trl_lora_sft", check_trl_lora),
    ("lens_fit_device_vs_cpu", check_lens),
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lhd_train.ops.gpu_check", description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda | cuda:N | cpu (cpu: smoke test on a CPU machine)")
    ap.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temp dir)")
    ap.add_argument("--only", default=None, help="comma-separated check names")
    ap.add_argument("--fast", action="store_true", help="fewer requests and prompts")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch is imported
    only = set(args.only.split(",")) if args.only else None
    work = args.work or Path(tempfile.mkdtemp(prefix="lhd-gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    ctx = Ctx(args.device, work, args.fast)
    failed = ran = 0
    t_all = time.perf_counter()
    for name, fn in CHECKS:
        if only and name not in only and name not in ("cuda", "tiny_model"):  # those two are prerequisites
            continue
        t0 = time.perf_counter()
        try:
            ok, detail = fn(ctx)
        except Exception as e:  # noqa: BLE001 - every check reports, none stops the others
            ok, detail = False, f"{type(e).__name__}: {e}".replace("\n", " ")[:500]
            traceback.print_exc(file=sys.stderr)
        emit(name, ok, f"{detail} [{time.perf_counter() - t0:.1f} s]")
        failed += not ok
        ran += 1
        if name in ("cuda", "tiny_model") and not ok:
            break
    print(f"gpu_check: {ran} checks, {failed} failed, "
          f"{time.perf_counter() - t_all:.0f} s, work dir {work}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
