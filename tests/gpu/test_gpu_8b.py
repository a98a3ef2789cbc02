"""Llama-3.1-8B at full size (issue 30, item 5): a random model with the real config (32 layers,
d 4096, vocabulary 128,256), built on the GPU in bf16 in seconds, nothing written to disk. The
tests measure what a slice cannot show, against the limits they meet:

- `hf_decode_8b`: the hf backend's own loop, rows x context 1 x 4k, 16 x 4k, 16 x 32k (and 16 x 4k
  JSON-constrained): decode tokens/s against the memory-bandwidth bound ((weights + rows x context x
  KV per token) / bandwidth per step), the device-to-device copy rate beside it, and the peak memory
  against the backend's own batch formula;
- `hf_long_row_8b`: one row of ~120k tokens: peak against the formula, prefill tokens/s against the
  bf16 matmul peak measured here;
- `train_8b`: one LoRA SFT step (8192 tokens), one DPO step (2 x 8192) and one GRPO step
  (transformers generation, 4 completions of a ~8k-token prompt) with TRL: seconds and peak;
- `lens_8b`: one prompt of 128 tokens at dim_batch 64 and, where the plan fits the GPU (H200, not H100
  80GB), 128: seconds and peak against `lens.plan`,
  and the host-side addition of its estimate to the running sums (`lens.accumulate`);
- `lens_bf16_vs_fp32`: the lens of a 4-layer slice in bf16 against fp32: relative Frobenius error per
  layer and top-1 agreement of the read-out.

The CPU form runs the same code on a small model of the same form."""
from __future__ import annotations

import asyncio
import gc
import json
import time
from pathlib import Path
from typing import Any

import pytest
from gpu_support import (
    LLAMA_8B,
    bandwidth_of,
    dtype_of,
    gib,
    is_cuda,
    lens_dim_batches,
    peak_since,
    reset_peak,
    sync,
    text_messages,
    verdict_schema,
)

from lhd_train.config.algos import ALGOS

SMALL = {"hidden_size": 256, "intermediate_size": 896, "num_attention_heads": 8, "num_key_value_heads": 2,
         "num_hidden_layers": 4, "vocab_size": 4096, "max_position_embeddings": 16384}


def build(device: str, tokenizer_dir: Path, layers: int | None = None, dtype: str | None = None) -> Any:
    """The random model on the device: Llama-3.1-8B's config (SMALL on CPU), its token ids set to the
    tiny model's tokenizer (prompts are tokenised with it; ids stay below its size)."""
    from lhd_train.tiny_model import random_llama
    from rollouts.tokenizer import load_tokenizer

    tok = load_tokenizer(str(tokenizer_dir))
    raw = json.loads(LLAMA_8B.read_text())
    if not is_cuda(device):
        raw.update(SMALL)
    if layers is not None:
        raw["num_hidden_layers"] = layers
    raw.update(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return random_llama(raw, device, dtype or dtype_of(device)), tok


@pytest.fixture(scope="module")
def eight_b(device, tiny4_dir):
    """(model, tokenizer), built once for the module's tests and freed after them."""
    built = build(device, tiny4_dir)
    yield built
    del built
    gc.collect()
    if is_cuda(device):
        import torch

        torch.cuda.empty_cache()


def backend_on(device: str, tokenizer_dir: Path, model: Any, tok: Any, rows: int) -> Any:
    import torch

    from rollouts.hf import HFBackend
    from rollouts.hf.spec import HFSpec

    spec = HFSpec(model=str(tokenizer_dir), device=device, dtype=dtype_of(device),
                     max_batch_size=rows, batch_wait_ms=500, enable_prefix_caching=False, max_model_len=131072)
    backend = HFBackend(spec, model, tok, device, getattr(torch, dtype_of(device)))
    backend.stop_set = set()  # fixed length: every row decodes exactly max_tokens (as the throughput benchmark)
    return backend


def run_requests(backend: Any, msgs: list[list[dict[str, str]]], new: int, schema: dict | None = None) -> list[Any]:
    from rollouts.types import GenerationRequest, SamplingParams

    reqs = [GenerationRequest(m, SamplingParams(temperature=1.0, max_tokens=new, seed=i), schema)
            for i, m in enumerate(msgs)]

    async def go():
        return [r for (r,) in await asyncio.gather(*(backend.generate([q]) for q in reqs))]

    return asyncio.run(go())


def copy_rate(device: str) -> float:
    """Device-to-device copy, bytes read + written per second (the practical bandwidth)."""
    import torch

    n = (2 << 30) if is_cuda(device) else (64 << 20)
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    sync(device)
    return 2 * n * 10 / (time.perf_counter() - t0)


def matmul_rate(device: str) -> float:
    import torch

    n = 8192 if is_cuda(device) else 512
    a = torch.randn(n, n, device=device, dtype=getattr(torch, dtype_of(device)))
    b = a @ a
    sync(device)
    t0 = time.perf_counter()
    for _ in range(10):
        b = a @ a
    sync(device)
    del b
    return 2 * n**3 * 10 / (time.perf_counter() - t0)


def test_hf_decode_8b(device, tiny4_dir, eight_b, measure):
    import torch

    from rollouts.hf.memory_plan import batch_bytes
    from rollouts.structured import schema_for

    model, tok = eight_b
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    cases = [(1, 4096, False), (16, 4096, False), (16, 4096, True), (16, 32768, False)]
    if not is_cuda(device):
        cases = [(1, 256, False), (4, 256, False), (4, 256, True), (4, 1024, False)]
    steps = 32
    bw = copy_rate(device)
    # the bound is the spec sheet's bandwidth for this GPU (H100 3.35, H200 4.8 TB/s); else the copy rate measured here
    named = bandwidth_of(torch.cuda.get_device_name(torch.device(device))) if is_cuda(device) else None
    bandwidth, source = (named, "the GPU's spec sheet") if named else (bw, "the copy rate measured here")
    parts, problems = [], []
    for rows, context, json_rows in cases:
        backend = backend_on(device, tiny4_dir, model, tok, rows)
        msgs = [text_messages(backend, context, i) for i in range(rows)]
        before = dict(backend.timings)
        base = reset_peak(device)
        results = run_requests(backend, msgs, steps, schema_for(verdict_schema()) if json_rows else None)
        peak = peak_since(device, base)
        asyncio.run(backend.aclose())
        errors = [r.error for r in results if not r.ok]
        done = sum(len(r.completions[0].token_ids or []) for r in results if r.ok)
        decode_s = sum(backend.timings[k] - before[k] for k in ("forward_s", "sample_s"))
        lens = [len(backend.encode_chat(m)) for m in msgs]
        step_bound = (weights + sum(lens) * backend.cost.kv) / bandwidth
        rate, bound = done / max(decode_s, 1e-9), rows / step_bound
        formula = batch_bytes(backend.cost, lens, [steps] * rows)
        case = f"{rows}x{max(lens)}{' JSON' if json_rows else ''}"
        if errors:
            problems.append(f"{case}: {errors[0]}")
        if not backend.decode_path.startswith("loop"):
            problems.append(f"{case}: decode path {backend.decode_path}, not lhd's own loop")
        if is_cuda(device) and peak > 1.15 * formula:
            problems.append(f"{case}: peak {gib(peak)} over 1.15 x the formula {gib(formula)}")
        parts.append(f"{case}: {rate:,.0f} tok/s decode ({decode_s:.1f} s), "
                     f"bandwidth bound {bound:,.0f} tok/s ({rate / bound:.0%}), prefill "
                     f"{backend.timings['prefill_s'] - before['prefill_s']:.1f} s, peak {gib(peak)} vs formula "
                     f"{gib(formula)}")
    measure(f"decode path {backend.decode_path}; weights {gib(weights)}; copy {bw / 1e12:.2f} TB/s read+write "
            f"(bound uses {bandwidth / 1e12:.3g} TB/s, {source}); " + "; ".join(parts))
    assert not problems, problems


def test_hf_long_row_8b(device, tiny4_dir, eight_b, measure):
    from rollouts.hf.memory_plan import batch_bytes

    model, tok = eight_b
    tokens = 120_000 if is_cuda(device) else 1024
    backend = backend_on(device, tiny4_dir, model, tok, 1)
    msgs = [text_messages(backend, tokens, 0)]
    n = len(backend.encode_chat(msgs[0]))
    flops = matmul_rate(device)
    before = backend.timings["prefill_s"]
    base = reset_peak(device)
    t0 = time.perf_counter()
    [res] = run_requests(backend, msgs, 4)
    wall = time.perf_counter() - t0
    peak = peak_since(device, base)
    asyncio.run(backend.aclose())
    prefill = max(backend.timings["prefill_s"] - before, 1e-9)
    params = sum(p.numel() for p in model.parameters())
    formula = batch_bytes(backend.cost, [n], [4])
    measure(f"one row of {n} tokens, decode path {backend.decode_path}: prefill {prefill:.1f} s = {n / prefill:,.0f} "
            f"tok/s, {2 * params * n / prefill / 1e12:.0f} TFLOP/s of the {flops / 1e12:.0f} measured matmul peak "
            f"(attention left out); {wall:.1f} s in all; peak {gib(peak)} vs formula {gib(formula)}")
    assert res.ok, res.error
    assert not is_cuda(device) or peak <= 1.15 * formula


def trl_step(device: str, work: Path, model: Any, tok: Any, algo: str, rows: list[dict[str, Any]],
             args: dict[str, Any]) -> tuple[float, int, float]:
    """One TRL step on the in-memory model with a LoRA adapter; (seconds, peak, loss); the adapter is
    unloaded afterwards so the next trainer starts from the plain base."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig

    cuda = is_cuda(device)
    common = {"output_dir": str(work / f"{algo}-8b"), "max_steps": 1, "per_device_train_batch_size": 1,
              "learning_rate": 1e-4, "logging_steps": 1, "save_strategy": "no", "report_to": "none",
              "bf16": cuda, "use_cpu": not cuda, "gradient_checkpointing": cuda, **args}
    kwargs: dict[str, Any] = {}
    if ALGOS[algo].online:
        kwargs["reward_funcs"] = [lambda completions, **_: [float(len(c[0]["content"])) for c in completions]]
    lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = ALGOS[algo].trainer_class()(model=model, args=ALGOS[algo].config_class()(**common),
                                          train_dataset=Dataset.from_list(rows),
                                          processing_class=tok, peft_config=lora, **kwargs)
    base = reset_peak(device)
    t0 = time.perf_counter()
    out = trainer.train()
    sync(device)
    secs, peak = time.perf_counter() - t0, peak_since(device, base)
    trainer.model.unload()
    del trainer
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return secs, peak, float(out.training_loss)


class TokenCounter:
    """What `text_messages` needs from a backend: a chat-template token count."""

    def __init__(self, tok: Any):
        self.tok = tok

    def count_tokens(self, messages: list[dict[str, str]]) -> int:
        return len(self.tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))


@pytest.mark.slow
def test_train_8b(device, eight_b, tmp_path, measure):
    model, tok = eight_b
    length = 8192 if is_cuda(device) else 512
    model.config.use_cache = False
    counter = TokenCounter(tok)
    answer = [{"role": "assistant", "content": "The report is complete and accurate."}]
    results, losses = [], {}
    try:
        for algo, rows, args in (
            ("sft", [{"messages": text_messages(counter, length - 32, 0) + answer}], {"max_length": length}),
            ("dpo", [{"prompt": text_messages(counter, length - 32, 1), "chosen": answer,
                      "rejected": [{"role": "assistant", "content": "Everything is done, no issues at all!"}]}],
             {"max_length": length}),
            ("grpo", [{"prompt": text_messages(counter, length - 64, 2)}],
             {"per_device_train_batch_size": 4, "num_generations": 4, "max_completion_length": 64, "use_vllm": False}),
        ):
            secs, peak, losses[algo] = trl_step(device, tmp_path, model, tok, algo, rows, args)
            results.append(f"{algo} {secs:.1f} s, peak {gib(peak)}, loss {losses[algo]:.3g}")
    finally:
        model.config.use_cache = True
    measure(f"LoRA r16, {length} tokens, vocabulary {model.config.vocab_size:,}: " + "; ".join(results))
    assert all(loss == loss for loss in losses.values()), losses  # not NaN


def test_lens_8b(device, eight_b, measure):
    import torch

    from lens.accumulate import _accumulate, _State
    from lens.fit import prompt_jacobian
    from lens.model import HFLensModel
    from lens.plan import ModelShape, plan_fit

    model, _ = eight_b
    lm = HFLensModel(model)
    n = lm.n_layers
    sources, target, tokens = list(range(n - 1)), n - 1, 128 if is_cuda(device) else 48
    shape = ModelShape.parse(model.config.to_dict())
    ids = torch.randint(3, 2000, (tokens,), generator=torch.Generator().manual_seed(0))
    parts, problems = [], []
    memory = torch.cuda.get_device_properties(torch.device(device)).total_memory if is_cuda(device) else 0
    batches = lens_dim_batches(shape, memory, sources, target, tokens) if is_cuda(device) else [16]
    for dim_batch in batches:
        base = reset_peak(device)
        t0 = time.perf_counter()
        J = prompt_jacobian(lm, ids, source_layers=sources, target_layer=target, skip_first=16, dim_batch=dim_batch)
        sync(device)
        secs, peak = time.perf_counter() - t0, peak_since(device, base)
        plan = plan_fit(shape, dtype=dtype_of(device), attn="sdpa", sources=sources, target=target, tokens=tokens,
                        dim_batch=dim_batch, device_type="cuda" if is_cuda(device) else "cpu")
        planned = plan.peak - plan.memory["weights"]
        if not bool(torch.isfinite(J).all()):
            problems.append(f"dim_batch {dim_batch}: J not finite")
        if is_cuda(device) and peak > 1.1 * planned:
            problems.append(f"dim_batch {dim_batch}: peak {gib(peak)} over 1.1 x the plan {gib(planned)}")
        parts.append(f"dim_batch {dim_batch}: {secs:.1f} s/prompt (plan {plan.seconds_per_prompt:.0f} s), peak "
                     f"{gib(peak)} vs plan {gib(planned)}")
    host = J.float().cpu()
    del J
    state = _State(*host.shape)
    _accumulate(state, host, 0, tokens, 0.0)
    t0 = time.perf_counter()
    _accumulate(state, host, 1, tokens, 0.0)
    parts.append(f"host sums: adding one estimate ({tuple(host.shape)} fp32) takes {time.perf_counter() - t0:.1f} s, "
                 "in a worker thread during the next prompt (lens.accumulate)")
    measure(f"{len(sources)} source layers, {tokens} tokens, {dtype_of(device)} sdpa: " + "; ".join(parts))
    assert not problems, problems


def bf16_agreement(device: str, tokenizer_dir: Path, layers: int = 4, tokens: int = 64,
                   dim_batch: int = 64) -> dict[str, Any]:
    """The lens of a `layers`-block model in bf16 against fp32 (same weights): per source layer the
    relative Frobenius error ||J_bf16 - J_fp32|| / ||J_fp32||, and how often the read-out's top token
    (final norm and head over J h, h the fp32 block output at each valid position) is the same."""
    import torch

    from lens.fit import prompt_jacobian
    from lens.model import HFLensModel, block_outputs

    model, _ = build(device, tokenizer_dir, layers=layers, dtype="float32")
    ids = torch.randint(3, 2000, (tokens,), generator=torch.Generator().manual_seed(1))
    sources, target = list(range(layers - 1)), layers - 1
    Js = {}
    for dtype in (torch.float32, torch.bfloat16):
        model.to(dtype)
        Js[dtype] = prompt_jacobian(HFLensModel(model), ids, source_layers=sources, target_layer=target, skip_first=8,
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


@pytest.mark.slow
def test_lens_bf16_vs_fp32(device, tiny4_dir, measure):
    cuda = is_cuda(device)
    m = bf16_agreement(device, tiny4_dir, layers=4, tokens=128 if cuda else 48, dim_batch=64 if cuda else 32)
    measure(f"d_model {m['d_model']}, {m['tokens']} tokens: relative Frobenius error per layer "
            + ", ".join(f"{k}: {v:.2e}" for k, v in m["rel_frobenius"].items())
            + "; read-out top-1 agreement " + ", ".join(f"{k}: {v:.1%}" for k, v in m["top1_agreement"].items()))
    assert max(m["rel_frobenius"].values()) < 0.1
