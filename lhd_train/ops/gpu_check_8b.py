"""Checks of `lhd_train.ops.gpu_check` at Llama-3.1-8B's full size (issue 30, item 5): a random model
with the real config (32 layers, d 4096, vocabulary 128,256), built on the GPU in bf16 in seconds,
nothing written to disk. They measure what the slice cannot show, against the limits they meet:

- `hf_decode_8b`: the hf backend's own loop, rows x context 1 x 4k, 16 x 4k, 16 x 32k (and 16 x 4k
  JSON-constrained): decode tokens/s against the memory-bandwidth bound ((weights + rows x context x
  KV per token) / bandwidth per step), the device-to-device copy rate beside it, and the peak memory
  against the backend's own batch formula;
- `hf_long_row_8b`: one row of ~120k tokens: peak against the formula, prefill tokens/s against the
  bf16 matmul peak measured here;
- `train_8b`: one LoRA SFT step (8192 tokens), one DPO step (2 x 8192) and one GRPO step
  (transformers generation, 4 completions of a ~8k-token prompt) with TRL: seconds and peak;
- `lens_8b`: one prompt of 128 tokens at dim_batch 64 and 128: seconds and peak against `lens.plan`,
  and the host-side addition of its estimate to the running sums (`lens.accumulate`);
- `lens_bf16_vs_fp32`: the lens of a 4-layer slice in bf16 against fp32: relative Frobenius error per
  layer and top-1 agreement of the read-out.

On CPU (`--device cpu`, the test suite) the same code runs on a small model of the same form.
"""
from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

from lhd_train.config.algos import ALGOS
from lhd_train.ops.gpu_check_base import Ctx, Outcome, gib, verdict, verdict_schema
from lhd_train.ops.gpu_check_slice import text_messages

ROOT = Path(__file__).resolve().parents[2]
LLAMA_8B = ROOT / "configs" / "models" / "llama-3.1-8b-instruct" / "config.json"
BANDWIDTH = 4.8e12  # H200 HBM3e, bytes/s (the spec sheet's); the measured copy rate is printed beside it
SMALL = {"hidden_size": 256, "intermediate_size": 896, "num_attention_heads": 8, "num_key_value_heads": 2,
         "num_hidden_layers": 4, "vocab_size": 4096, "max_position_embeddings": 16384}


def _sync(ctx: Ctx) -> None:
    import torch

    if ctx.cuda:
        torch.cuda.synchronize(ctx.device)


def build(ctx: Ctx, layers: int | None = None, dtype: str | None = None) -> Any:
    """The random model on the device: Llama-3.1-8B's config (SMALL on CPU / --small), its token ids
    set to the tiny model's tokenizer (prompts are tokenised with it; ids stay below its size)."""
    from lhd_train.tiny_model import random_llama
    from rollouts.tokenizer import load_tokenizer

    assert ctx.model_dir is not None
    tok = load_tokenizer(str(ctx.model_dir))
    raw = json.loads(LLAMA_8B.read_text())
    if ctx.small or not ctx.cuda:
        raw.update(SMALL)
    if layers is not None:
        raw["num_hidden_layers"] = layers
    raw.update(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return random_llama(raw, ctx.device, dtype or ctx.dtype), tok


def _eight_b(ctx: Ctx) -> tuple[Any, Any]:
    if getattr(ctx, "big", None) is None:
        ctx.big = build(ctx)  # type: ignore[attr-defined]
    return ctx.big  # type: ignore[attr-defined]


def _backend(ctx: Ctx, model: Any, tok: Any, rows: int) -> Any:
    import torch

    from rollouts.hf import HFBackend
    from rollouts.hf.spec import HFSpec

    spec = HFSpec(model=str(ctx.model_dir), device=ctx.device, dtype=ctx.dtype, max_batch_size=rows,
                     batch_wait_ms=500, enable_prefix_caching=False, max_model_len=131072)
    backend = HFBackend(spec, model, tok, ctx.device, getattr(torch, ctx.dtype))
    backend.stop_set = set()  # fixed length: every row decodes exactly max_tokens (as the throughput benchmark)
    return backend


def _run(backend: Any, msgs: list[list[dict[str, str]]], new: int, schema: dict | None = None) -> list[Any]:
    from rollouts.types import GenerationRequest, SamplingParams

    reqs = [GenerationRequest(m, SamplingParams(temperature=1.0, max_tokens=new, seed=i), schema)
            for i, m in enumerate(msgs)]

    async def go():
        return [r for (r,) in await asyncio.gather(*(backend.generate([q]) for q in reqs))]

    return asyncio.run(go())


def copy_rate(ctx: Ctx) -> float:
    """Device-to-device copy, bytes read + written per second (the practical bandwidth)."""
    import torch

    n = (2 << 30) if ctx.cuda else (64 << 20)
    a = torch.empty(n, dtype=torch.uint8, device=ctx.device)
    b = torch.empty_like(a)
    b.copy_(a)
    _sync(ctx)
    t0 = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    _sync(ctx)
    return 2 * n * 10 / (time.perf_counter() - t0)


def matmul_rate(ctx: Ctx) -> float:
    import torch

    n = 8192 if ctx.cuda else 512
    a = torch.randn(n, n, device=ctx.device, dtype=getattr(torch, ctx.dtype))
    b = a @ a
    _sync(ctx)
    t0 = time.perf_counter()
    for _ in range(10):
        b = a @ a
    _sync(ctx)
    del b
    return 2 * n**3 * 10 / (time.perf_counter() - t0)


def check_hf_decode(ctx: Ctx) -> Outcome:
    from rollouts.hf.memory_plan import batch_bytes
    from rollouts.structured import schema_for

    model, tok = _eight_b(ctx)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    cases = [(1, 4096, False), (16, 4096, False), (16, 4096, True), (16, 32768, False)]
    if ctx.small or not ctx.cuda:
        cases = [(1, 256, False), (4, 256, False), (4, 256, True), (4, 1024, False)]
    steps = 32
    bw = copy_rate(ctx)
    parts, ok = [], True
    for rows, context, json_rows in cases:
        backend = _backend(ctx, model, tok, rows)
        msgs = [text_messages(backend, context, i) for i in range(rows)]
        before = dict(backend.timings)
        base = ctx.reset_peak()
        results = _run(backend, msgs, steps, schema_for(verdict_schema()) if json_rows else None)
        peak = ctx.peak_since(base)
        asyncio.run(backend.aclose())
        errors = [r.error for r in results if not r.ok]
        done = sum(len(r.completions[0].token_ids or []) for r in results if r.ok)
        decode_s = sum(backend.timings[k] - before[k] for k in ("forward_s", "sample_s"))
        lens = [len(backend.encode_chat(m)) for m in msgs]
        per_token = backend.cost.kv
        step_bound = (weights + sum(lens) * per_token) / BANDWIDTH
        rate, bound = done / max(decode_s, 1e-9), rows / step_bound
        formula = batch_bytes(backend.cost, lens, [steps] * rows)
        path = backend.decode_path
        ok = ok and not errors and path.startswith("loop") and (not ctx.cuda or peak <= 1.15 * formula)
        parts.append(f"{rows}x{max(lens)}{' JSON' if json_rows else ''}: {rate:,.0f} tok/s decode ({decode_s:.1f} s), "
                     f"bandwidth bound {bound:,.0f} tok/s ({rate / bound:.0%}), prefill "
                     f"{backend.timings['prefill_s'] - before['prefill_s']:.1f} s, peak {gib(peak)} vs formula "
                     f"{gib(formula)}" + (f", errors: {errors[0]}" if errors else ""))
    return verdict(ok), (f"decode path {path}; weights {gib(weights)}; copy {bw / 1e12:.2f} TB/s read+write "
                         f"(bound uses {BANDWIDTH / 1e12:g} TB/s); " + "; ".join(parts))


def check_long_row(ctx: Ctx) -> Outcome:
    from rollouts.hf.memory_plan import batch_bytes

    model, tok = _eight_b(ctx)
    tokens = 1024 if (ctx.small or not ctx.cuda) else 120_000
    backend = _backend(ctx, model, tok, 1)
    msgs = [text_messages(backend, tokens, 0)]
    n = len(backend.encode_chat(msgs[0]))
    flops = matmul_rate(ctx)
    before = backend.timings["prefill_s"]
    base = ctx.reset_peak()
    t0 = time.perf_counter()
    [res] = _run(backend, msgs, 4)
    wall = time.perf_counter() - t0
    peak = ctx.peak_since(base)
    asyncio.run(backend.aclose())
    prefill = max(backend.timings["prefill_s"] - before, 1e-9)
    params = sum(p.numel() for p in model.parameters())
    formula = batch_bytes(backend.cost, [n], [4])
    detail = (f"one row of {n} tokens, decode path {backend.decode_path}: prefill {prefill:.1f} s = {n / prefill:,.0f} "
              f"tok/s, {2 * params * n / prefill / 1e12:.0f} TFLOP/s of the {flops / 1e12:.0f} measured matmul peak "
              f"(attention left out); {wall:.1f} s in all; peak {gib(peak)} vs formula {gib(formula)}"
              + (f"; error: {res.error}" if res.error else ""))
    return verdict(res.ok and (not ctx.cuda or peak <= 1.15 * formula)), detail


def _trl_step(ctx: Ctx, model: Any, tok: Any, algo: str, rows: list[dict[str, Any]], args: dict[str, Any]):
    """One TRL step on the in-memory model with a LoRA adapter; (seconds, peak, loss); the adapter is
    unloaded afterwards so the next trainer starts from the plain base."""
    import gc

    import torch
    from datasets import Dataset
    from peft import LoraConfig

    common = {"output_dir": str(ctx.work / f"{algo}-8b"), "max_steps": 1, "per_device_train_batch_size": 1,
              "learning_rate": 1e-4, "logging_steps": 1, "save_strategy": "no", "report_to": "none",
              "bf16": ctx.cuda, "use_cpu": not ctx.cuda, "gradient_checkpointing": ctx.cuda, **args}
    kwargs: dict[str, Any] = {}
    if ALGOS[algo].online:
        kwargs["reward_funcs"] = [lambda completions, **_: [float(len(c[0]["content"])) for c in completions]]
    lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = ALGOS[algo].trainer_class()(model=model, args=ALGOS[algo].config_class()(**common),
                                          train_dataset=Dataset.from_list(rows), processing_class=tok,
                                          peft_config=lora, **kwargs)
    base = ctx.reset_peak()
    t0 = time.perf_counter()
    out = trainer.train()
    _sync(ctx)
    secs, peak = time.perf_counter() - t0, ctx.peak_since(base)
    trainer.model.unload()
    del trainer
    gc.collect()
    if ctx.cuda:
        torch.cuda.empty_cache()
    return secs, peak, float(out.training_loss)


def check_train(ctx: Ctx) -> Outcome:
    model, tok = _eight_b(ctx)
    length = 512 if (ctx.small or not ctx.cuda) else 8192
    model.config.use_cache = False

    def long_prompt(i: int, tokens: int) -> list[dict[str, str]]:
        return [m for m in text_messages(_Counter(tok), tokens, i)]

    answer = [{"role": "assistant", "content": "The report is complete and accurate."}]
    results, ok = [], True
    for algo, rows, args in (
        ("sft", [{"messages": long_prompt(0, length - 32) + answer}], {"max_length": length}),
        ("dpo", [{"prompt": long_prompt(1, length - 32), "chosen": answer,
                  "rejected": [{"role": "assistant", "content": "Everything is done, no issues at all!"}]}],
         {"max_length": length}),
        ("grpo", [{"prompt": long_prompt(2, length - 64)}], {"per_device_train_batch_size": 4, "num_generations": 4,
                                                              "max_completion_length": 64, "use_vllm": False}),
    ):
        secs, peak, loss = _trl_step(ctx, model, tok, algo, rows, args)
        ok = ok and loss == loss
        results.append(f"{algo} {secs:.1f} s, peak {gib(peak)}, loss {loss:.3g}")
    model.config.use_cache = True
    vocab = model.config.vocab_size
    return verdict(ok), f"LoRA r16, {length} tokens, vocabulary {vocab:,}: " + "; ".join(results)


class _Counter:
    """What `text_messages` needs from a backend: a chat-template token count."""

    def __init__(self, tok: Any):
        self.tok = tok

    def count_tokens(self, messages: list[dict[str, str]]) -> int:
        return len(self.tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))


def check_lens(ctx: Ctx) -> Outcome:
    import torch

    from lens.accumulate import _accumulate, _State
    from lens.fit import prompt_jacobian
    from lens.model import HFLensModel
    from lens.plan import ModelShape, plan_fit

    model, _ = _eight_b(ctx)
    lm = HFLensModel(model)
    n = lm.n_layers
    sources, target, tokens = list(range(n - 1)), n - 1, 128 if ctx.cuda else 48
    shape = ModelShape.parse(model.config.to_dict())
    ids = torch.randint(3, 2000, (tokens,), generator=torch.Generator().manual_seed(0))
    parts, ok = [], True
    for dim_batch in ((64, 128) if ctx.cuda else (16,)):
        base = ctx.reset_peak()
        t0 = time.perf_counter()
        J = prompt_jacobian(lm, ids, source_layers=sources, target_layer=target, skip_first=16, dim_batch=dim_batch)
        _sync(ctx)
        secs, peak = time.perf_counter() - t0, ctx.peak_since(base)
        plan = plan_fit(shape, dtype=ctx.dtype, attn="sdpa", sources=sources, target=target, tokens=tokens,
                        dim_batch=dim_batch, device_type="cuda" if ctx.cuda else "cpu")
        planned = plan.peak - plan.memory["weights"]
        ok = ok and bool(torch.isfinite(J).all()) and (not ctx.cuda or peak <= 1.1 * planned)
        parts.append(f"dim_batch {dim_batch}: {secs:.1f} s/prompt (plan {plan.seconds_per_prompt:.0f} s), peak "
                     f"{gib(peak)} vs plan {gib(planned)}")
    host = J.float().cpu()
    del J
    state = _State(*host.shape)
    _accumulate(state, host, 0, tokens, 0.0)
    t0 = time.perf_counter()
    _accumulate(state, host, 1, tokens, 0.0)
    add_s = time.perf_counter() - t0
    parts.append(f"host sums: adding one estimate ({tuple(host.shape)} fp32) takes {add_s:.1f} s, in a worker "
                 "thread during the next prompt (lens.accumulate)")
    return verdict(ok), f"{len(sources)} source layers, {tokens} tokens, {ctx.dtype} sdpa: " + "; ".join(parts)


def bf16_agreement(ctx: Ctx, layers: int = 4, tokens: int = 64, dim_batch: int = 64) -> dict[str, Any]:
    """The lens of a `layers`-block model in bf16 against fp32 (same weights): per source layer the
    relative Frobenius error ||J_bf16 - J_fp32|| / ||J_fp32||, and how often the read-out's top token
    (final norm and head over J h, h the fp32 block output at each valid position) is the same."""
    import torch

    from lens.fit import prompt_jacobian
    from lens.model import HFLensModel, block_outputs

    model, _ = build(ctx, layers=layers, dtype="float32")
    ids = torch.randint(3, 2000, (tokens,), generator=torch.Generator().manual_seed(1))
    sources, target = list(range(layers - 1)), layers - 1
    Js = {}
    for dtype in (torch.float32, torch.bfloat16):
        model.to(dtype)
        lm = HFLensModel(model)
        Js[dtype] = prompt_jacobian(lm, ids, source_layers=sources, target_layer=target, skip_first=8,
                                    dim_batch=dim_batch).float()
    model.to(torch.float32)
    lm = HFLensModel(model)
    acts = block_outputs(lm, ids[None].to(lm.device), sources)
    rel, agree = {}, {}
    for i, layer in enumerate(sources):
        a, b = Js[torch.float32][i], Js[torch.bfloat16][i]
        rel[layer] = float(torch.linalg.matrix_norm(b - a) / torch.linalg.matrix_norm(a))
        h = acts[layer][0, 8:-1].float()
        with torch.no_grad():
            top_a = lm.unembed(h @ a.T).argmax(-1)
            top_b = lm.unembed(h @ b.T).argmax(-1)
        agree[layer] = float((top_a == top_b).float().mean())
    return {"rel_frobenius": rel, "top1_agreement": agree, "tokens": tokens, "d_model": model.config.hidden_size}


def check_lens_bf16(ctx: Ctx) -> Outcome:
    m = bf16_agreement(ctx, layers=4, tokens=128 if ctx.cuda else 48, dim_batch=64 if ctx.cuda else 32)
    worst = max(m["rel_frobenius"].values())
    detail = (f"d_model {m['d_model']}, {m['tokens']} tokens: relative Frobenius error per layer "
              + ", ".join(f"{k}: {v:.2e}" for k, v in m["rel_frobenius"].items())
              + "; read-out top-1 agreement " + ", ".join(f"{k}: {v:.1%}" for k, v in m["top1_agreement"].items()))
    return verdict(worst < 0.1), detail
