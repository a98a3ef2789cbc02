"""Checks of `lhd_train.ops.gpu_check` on an 8B-shaped slice: Llama-3.1-8B's block (d 4096, ffn
14336, 32 query / 8 key-value heads) with 4 layers and random weights, so memory per token and
time per block are the real model's while a run takes seconds. Each check compares a measurement
with the project's own planner (`rollouts/hf/memory_plan.py`, `lens/plan.py`) and projects it to
the full model (its config.json in configs/models/)."""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any, TypedDict

from lhd_train.ops.gpu_check_base import Ctx, Outcome, gib, json_run, proj, verdict

ROOT = Path(__file__).resolve().parents[2]
LLAMA_8B = ROOT / "configs" / "models" / "llama-3.1-8b-instruct" / "config.json"
SLICE_LAYERS = 4


class SliceShape(TypedDict):
    """The per-layer shape of the slice model (arguments of `build_tiny_model`)."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int


SLICE_8B = SliceShape(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336)
SLICE_SMALL = SliceShape(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, intermediate_size=896)
# What torch reports as total memory: H100 80 GB and H200 141 GB.
GPUS_GIB = {"H100 80GB": 79.1, "H200 141GB": 139.8}
WORDS = "region units sold price demand budget report plan week team venue risk status".split()


def slice_dir(ctx: Ctx) -> tuple[Path | None, str]:
    """The slice's folder (built once, by the project's one random-model builder), or why not."""
    if ctx.slice_dir is not None:
        return ctx.slice_dir, ""
    from lhd_train.tiny_model import build_tiny_model

    dims = SLICE_SMALL if ctx.small else SLICE_8B
    ctx.slice_dir = build_tiny_model("llama", ctx.work / "slice-8b", seed=0, num_layers=SLICE_LAYERS,
                                     max_position_embeddings=131072, tie_word_embeddings=False, **dims)
    return ctx.slice_dir, ""


def text_messages(backend: Any, tokens: int, i: int) -> list[dict[str, str]]:
    """A system and a user message of about `tokens` tokens (as the backend counts them)."""
    def messages(n_words: int) -> list[dict[str, str]]:
        text = " ".join(f"{WORDS[(i * 7 + j * 3) % len(WORDS)]}{j % 97}" for j in range(n_words))
        return [{"role": "system", "content": "You audit."}, {"role": "user", "content": text}]

    per_word = backend.count_tokens(messages(200)) / 200
    return messages(max(1, int(tokens / per_word)))


def hf_backend(ctx: Ctx, model: Path, **spec: Any) -> Any:
    from rollouts.hf import HFBackend
    from rollouts.hf.spec import HFSpec

    return HFBackend.from_spec(HFSpec(model=str(model), device=ctx.device, dtype=ctx.dtype,
                                         enable_prefix_caching=False, **spec))


def project_hf_8b() -> None:
    """PROJ lines: how many rows of 32k and 127k tokens the hf backend admits for Llama-3.1-8B."""
    if not LLAMA_8B.is_file():
        return
    from lens.plan import ModelShape
    from rollouts.hf.memory_plan import TokenCost, admit, batch_bytes, plan_budget

    cfg = json.loads(LLAMA_8B.read_text())
    shape = TokenCost.of(ModelShape.parse(cfg), 2)
    weights = ModelShape.parse(cfg).n_params * 2
    for gpu, total_gib in GPUS_GIB.items():
        total = int(total_gib * 2**30)
        budget = plan_budget("cuda", total - weights - 2**30, total, None, None, True)
        fits = []
        for length in (32768, 131072 - 4096):
            one = batch_bytes(shape, [length], [256])
            rows = len(admit(shape, budget.batch, [(length, 256)] * 16, 16)) if one <= budget.batch else 0
            fits.append(f"{rows} row(s) of {length} tokens (one row {gib(one)})")
        proj(f"hf backend, Llama-3.1-8B bf16 on {gpu}: weights {gib(weights)}, KV {shape.kv // 1024} "
             f"KiB/token, batch budget {gib(budget.batch)}, prefix cache {gib(budget.prefix)}: admits "
             + ", ".join(fits) + " per batch")


def check_hf_kv_memory(ctx: Ctx) -> Outcome:
    """H6: the backend's measured peak for a batch of ~4k-token prompts against its own formula."""
    model, why = slice_dir(ctx)
    if model is None:
        return "SKIP", why
    from rollouts.hf.memory_plan import batch_bytes

    n, tokens, new = (4, 300, 64) if ctx.small else (8, 4000, 64)
    backend = hf_backend(ctx, model, max_batch_size=n, batch_wait_ms=500)
    msgs = [text_messages(backend, tokens, i) for i in range(n)]
    lens = sorted(backend.count_tokens(m) for m in msgs)
    budget, shape = backend.budget, backend.cost
    base = ctx.reset_peak()
    bad, secs = json_run(backend, n, lambda i: msgs[i], new, every=2)
    peak = ctx.peak_since(base)
    rows = max(1, backend.stats["max_batch_rows"])
    formula = batch_bytes(shape, lens[-rows:], [new] * rows)
    detail = (f"{n} prompts of {lens[0]}-{lens[-1]} tokens, half JSON, {backend.stats['batches']} batch(es) of up to "
              f"{rows} rows in {secs:.1f} s; KV {shape.kv // 1024} KiB/token; batch budget "
              f"{gib(budget.batch)} ({budget.source}); formula for the largest batch {gib(formula)}")
    if bad:
        detail += f"; problems: {' | '.join(bad[:2])}"
    if not ctx.cuda:
        return verdict(not bad), detail + "; peak not measured on cpu"
    project_hf_8b()
    ratio = peak / formula
    detail += (f"; measured peak {gib(peak)} = {ratio:.2f} x the formula "
               "(PASS at <= 1.15: the budget does not under-count)")
    return verdict(not bad and ratio <= 1.15), detail


def check_hf_oom_split(ctx: Ctx) -> Outcome:
    """H6: a batch that really runs out of GPU memory is split and retried; every row finishes."""
    if not ctx.cuda:
        return "SKIP", "needs CUDA (a real out-of-memory error)"
    model, why = slice_dir(ctx)
    if model is None:
        return "SKIP", why
    import torch

    from rollouts.hf.memory_plan import batch_bytes
    from rollouts.types import GenerationRequest, SamplingParams

    rows, new, tokens = 16, 8, (1024 if ctx.small else 8192)
    # kv_budget_gib far above the GPU: admission lets the whole batch through, so the GPU decides
    backend = hf_backend(ctx, model, max_batch_size=rows, batch_wait_ms=50, kv_budget_gib=10_000.0)
    msgs = text_messages(backend, tokens, 0)
    plen = backend.count_tokens(msgs)
    need_all = batch_bytes(backend.cost, [plen] * rows, [new] * rows)
    need_quarter = batch_bytes(backend.cost, [plen] * (rows // 4), [new] * (rows // 4))
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(torch.device(ctx.device))
    leave = int(1.3 * need_quarter) + 2**28
    ballast = torch.empty(max(0, free - leave), dtype=torch.uint8, device=ctx.device)  # fills the rest of the GPU
    request = GenerationRequest(msgs, SamplingParams(temperature=1.0, max_tokens=new, seed=1, n=rows))

    async def go():
        try:
            return (await backend.generate([request]))[0]
        finally:
            await backend.aclose()

    import asyncio

    try:
        res = asyncio.run(go())
    finally:
        del ballast
        torch.cuda.empty_cache()
    splits, failed = backend.stats["oom_splits"], backend.stats["oom_rows_failed"]
    detail = (f"one request of {plen} prompt tokens x n={rows} rows with {gib(leave)} of the GPU left (formula: "
              f"{gib(need_all)} for all rows, {gib(need_quarter)} for a quarter): {splits} split(s), {failed} row(s) "
              f"out of memory alone, {len(res.completions)} completions"
              + (f", error: {res.error}" if res.error else ""))
    if splits == 0 and res.ok:
        return "SKIP", "no out-of-memory error provoked; " + detail
    return verdict(res.ok and len(res.completions) == rows and failed == 0), detail


def check_lens_slice(ctx: Ctx) -> Outcome:
    """M5: the lens's peak memory and time per prompt on the slice against lens/plan.py, projected
    to Llama-3.1-8B (31 source layers)."""
    model, why = slice_dir(ctx)
    if model is None:
        return "SKIP", why
    import time

    import torch

    from lens.fit import prompt_jacobian
    from lens.model import load_hf
    from lens.plan import ModelShape, plan_fit

    tokens, dim_batch = (32, 32) if ctx.small else (128, 64)
    device_type = "cuda" if ctx.cuda else "cpu"
    shape = ModelShape.parse(json.loads((model / "config.json").read_text()), str(model / "config.json"))
    lm, _ = load_hf(str(model), dtype=ctx.dtype, device=ctx.device, attn_implementation="sdpa")
    ids = torch.randint(3, 2000, (tokens,), generator=torch.Generator().manual_seed(0))
    sources, target = list(range(SLICE_LAYERS - 1)), SLICE_LAYERS - 1
    prompt_jacobian(lm, ids, source_layers=sources, target_layer=target, skip_first=16, dim_batch=dim_batch,
                    directions=torch.eye(shape.d_model)[:dim_batch].to(ctx.device))  # warm-up
    base = ctx.reset_peak()
    t0 = time.perf_counter()
    J = prompt_jacobian(lm, ids, source_layers=sources, target_layer=target, skip_first=16, dim_batch=dim_batch)
    if ctx.cuda:
        torch.cuda.synchronize(ctx.device)
    secs = time.perf_counter() - t0
    peak = ctx.peak_since(base)
    finite = bool(torch.isfinite(J).all())
    del J, lm
    plan = plan_fit(shape, dtype=ctx.dtype, attn="sdpa", sources=sources, target=target, tokens=tokens,
                    dim_batch=dim_batch, device_type=device_type)
    planned = plan.peak - plan.memory["weights"]  # the weights were loaded before the measurement
    rate = plan.flops / secs / 1e12
    detail = (f"{ctx.dtype} sdpa, {tokens} tokens, dim_batch {dim_batch}, {len(sources)} source layers: {secs:.2f} s "
              f"per prompt ({rate:.1f} TFLOP/s sustained; planner assumes {plan.tflops:g}), finite {finite}; "
              f"planner peak without weights {gib(planned)}")
    if not ctx.cuda:
        return verdict(finite), detail + "; peak not measured on cpu"
    ratio = peak / planned
    detail += f", measured {gib(peak)} = {ratio:.2f} x the plan (PASS at <= 1.1: the plan does not under-count)"
    if LLAMA_8B.is_file():
        full = ModelShape.parse(json.loads(LLAMA_8B.read_text()), str(LLAMA_8B))
        plan_full = functools.partial(plan_fit, full, dtype="bfloat16", attn="sdpa",
                                      sources=list(range(full.n_layers - 1)), target=full.n_layers - 1, tokens=128,
                                      device_type="cuda", tflops=rate)
        p64 = plan_full(dim_batch=64)
        measured = p64.memory["weights"] + (peak - plan.memory["per-prompt J (out, fp32)"]) * (full.n_layers - 1) / \
            len(sources) + p64.memory["per-prompt J (out, fp32)"]
        proj(f"lens fit Llama-3.1-8B bf16 sdpa dim_batch 64, 128 tokens: planner peak {gib(p64.peak)}, slice "
             f"measurement scaled to {full.n_layers - 1} layers {gib(measured)}; {p64.seconds_per_prompt:.0f} s per "
             f"prompt at the measured {rate:.0f} TFLOP/s")
        for gpu, total_gib in GPUS_GIB.items():
            auto = plan_full(budget=int(total_gib * 2**30))
            proj(f"lens fit Llama-3.1-8B on {gpu}: planner picks dim_batch {auto.dim_batch}, peak {gib(auto.peak)}, "
                 f"fits {auto.fits}, {auto.seconds_per_prompt:.0f} s per prompt")
    return verdict(finite and ratio <= 1.1), detail
