"""`hf` backend memory (issue 20, H6/M6/M7/L7): batches sized from a budget computed from the
model config, an out-of-memory batch split and retried, the decode on the model's own CUDA device,
xgrammar's torch-native kernel when Triton cannot run, a prefix cache sized with the GPU."""
from __future__ import annotations

import asyncio
import logging
import threading

import pytest
import torch

import rollouts.hf.decode as hf_decode
from rollouts.backend import BackendError
from rollouts.hf import HFBackend
from rollouts.hf.device import device_context, free_memory, resolve_device
from rollouts.hf.memory_plan import GIB, TokenCost, admit, batch_bytes, plan_budget
from rollouts.hf.spec import HFSpec
from rollouts.model_config import ModelShape
from rollouts.types import GenerationRequest, SamplingParams

KIB = 1024
SCHEMA = {"type": "object", "properties": {"status": {"type": "string", "maxLength": 10}, "ok": {"type": "boolean"}},
          "required": ["status", "ok"], "additionalProperties": False}


def llama31_8b():
    """Llama-3.1-8B's published config.json shape (no weights)."""
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072)


def make(path, **kw) -> HFBackend:
    return HFBackend.from_spec(HFSpec(model=str(path), batch_wait_ms=30, max_batch_size=32, **kw))


def req(content, max_tokens=12, seed=0, n=1, schema=None, temperature=1.0):
    return GenerationRequest([{"role": "user", "content": content}],
                             SamplingParams(temperature=temperature, top_p=1.0, max_tokens=max_tokens, seed=seed, n=n),
                             schema)


def together(backend, requests):
    async def go():
        return [r for (r,) in await asyncio.gather(*[backend.generate([q]) for q in requests])]
    return asyncio.run(go())


def tokens(results):
    return [[c.token_ids for c in r.completions] for r in results]


# ---------------------------------------------------------------- the arithmetic
def test_kv_bytes_per_token_from_real_configs(tiny_llama_dir, tiny_qwen3_dir):
    from transformers import AutoConfig, Qwen3Config

    # tiny models: 2 layers x 2 kv heads x head_dim 16, float32
    for path in (tiny_llama_dir, tiny_qwen3_dir):
        assert TokenCost.of(ModelShape.parse(AutoConfig.from_pretrained(path)), 4).kv == 2 * 2 * 2 * 16 * 4
    assert TokenCost.of(ModelShape.parse(llama31_8b()), 2).kv == 128 * KIB  # GQA: 8 of 32 heads
    # Qwen3-0.6B: head_dim 128 given explicitly, not hidden 1024 / 16 heads = 64
    qwen3 = Qwen3Config(hidden_size=1024, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                        num_hidden_layers=28, intermediate_size=3072)
    assert TokenCost.of(ModelShape.parse(qwen3), 2).kv == 2 * 28 * 8 * 128 * 2
    # a config.json dict, multi-head attention (no num_key_value_heads), nested text_config
    mha = {"text_config": {"hidden_size": 512, "num_attention_heads": 8, "num_hidden_layers": 4}}
    assert TokenCost.of(ModelShape.parse(mha), 2).kv == 2 * 4 * 8 * 64 * 2
    with pytest.raises(BackendError, match="num_attention_heads"):
        ModelShape.parse({"hidden_size": 8})


def test_formula_matches_the_real_cache_and_the_decode_loops_buffers(tiny_llama_dir, monkeypatch):
    """Per-token bytes equal the keys/values a real prefill stores, and the batch formula equals
    what `decode_loop` allocates for its batched buffers (budgets under 256 tokens: no growth)."""
    from transformers import DynamicCache

    from rollouts.hf.kv_buffer import BufferLayer

    backend = make(tiny_llama_dir)
    cache = DynamicCache()
    with torch.inference_mode():
        backend.model(input_ids=torch.arange(1, 38).unsqueeze(0), use_cache=True, **{backend.cache_arg: cache})
    real = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    assert real == 37 * backend.cost.kv

    allocated = []
    orig = BufferLayer.__init__

    def record(self, kbuf, vbuf, length):
        allocated.append(kbuf.nbytes + vbuf.nbytes)
        orig(self, kbuf, vbuf, length)

    monkeypatch.setattr(BufferLayer, "__init__", record)
    requests = [req("short", max_tokens=9), req("a longer prompt here " * 12, max_tokens=20)]
    results = together(backend, requests)
    assert all(r.ok for r in results) and backend.stats["max_batch_rows"] == 2
    lens = [r.prompt_tokens for r in results]
    expected = batch_bytes(backend.cost, lens, [9, 20]) - backend.cost.kv * max(lens) \
        - backend.cost.prefill * max(lens)  # less the prefill cache and activations
    assert sum(allocated) == expected


def test_admission_order_budget_and_8b_sizes():
    shape = TokenCost.of(ModelShape.parse(llama31_8b()), 2)
    # 16 rows of 32k tokens (+4k new) on an H100's free memory after 8B weights: only some fit
    budget = plan_budget("cuda", free=64 * GIB, total=80 * GIB, kv_budget_gib=None, prefix_cache_gib=None,
                         prefix_enabled=True)
    rows = [(32768, 4096)] * 16
    picked = admit(shape, budget.batch, rows, max_rows=16)
    assert 1 <= len(picked) < 16
    assert batch_bytes(shape, [32768] * len(picked), [4096] * len(picked)) <= budget.batch
    assert batch_bytes(shape, [32768] * (len(picked) + 1), [4096] * (len(picked) + 1)) > budget.batch
    # the oldest row first, then the others shortest first
    rows = [(9000, 100), (50, 100), (20000, 100), (10, 100), (4000, 100)]
    tight = batch_bytes(shape, [9000, 10, 50, 4000], [100] * 4)
    assert admit(shape, tight, rows, max_rows=8) == [0, 3, 1, 4]
    assert admit(shape, 10 * tight, rows, max_rows=2) == [0, 3]


def test_budgets_explicit_default_and_prefix_cache_scaled_on_cuda():
    gpu = plan_budget("cuda", free=64 * GIB, total=80 * GIB, kv_budget_gib=None, prefix_cache_gib=None,
                      prefix_enabled=True)
    usable = 64 * GIB - 2 * GIB - int(0.05 * 80 * GIB)
    assert gpu.prefix + gpu.batch == usable and gpu.prefix == int(0.2 * usable)
    # L7: one 16k-token and even a 64k-token Llama-3.1-8B entry fit (a fixed 2 GiB held at most 16,384)
    assert gpu.prefix >= 65536 * 128 * KIB
    small = plan_budget("cuda", free=20 * GIB, total=24 * GIB, kv_budget_gib=None, prefix_cache_gib=None,
                        prefix_enabled=True)
    assert small.prefix < gpu.prefix
    explicit = plan_budget("cuda", free=64 * GIB, total=80 * GIB, kv_budget_gib=10, prefix_cache_gib=3,
                           prefix_enabled=True)
    assert (explicit.batch, explicit.prefix, explicit.source) == (10 * GIB, 3 * GIB, "kv_budget_gib")
    assert plan_budget("cuda", 64 * GIB, 80 * GIB, None, 3, prefix_enabled=False).prefix == 0
    # CPU keeps its 2 GiB prefix cache; batches get the available memory (with a generous floor)
    cpu = plan_budget("cpu", free=20 * GIB, total=None, kv_budget_gib=None, prefix_cache_gib=None, prefix_enabled=True)
    assert (cpu.prefix, cpu.batch) == (2 * GIB, 18 * GIB)
    assert plan_budget("cpu", 1 * GIB, None, None, None, True).batch == 4 * GIB


def test_cpu_backend_keeps_a_2_gib_prefix_cache(tiny_llama_dir):
    backend = make(tiny_llama_dir)
    assert backend.prefix_cache.max_bytes == 2 * GIB
    assert backend.budget.batch >= 4 * GIB
    d = backend.describe()
    assert d["prefix_cache_gib"] == 2.0 and d["kv_bytes_per_token"] == 512


# ---------------------------------------------------------------- admission in the backend
def test_batches_are_sized_from_the_budget(tiny_llama_dir):
    contents = [f"row {i} " + "words in the prompt " * 8 for i in range(6)]
    free = make(tiny_llama_dir)
    reference = together(free, [req(c, seed=i) for i, c in enumerate(contents)])
    assert free.stats["max_batch_rows"] == 6
    lens = sorted(r.prompt_tokens for r in reference)
    two = batch_bytes(free.cost, lens[-2:], [12, 12])  # any two rows fit, no three do
    assert batch_bytes(free.cost, lens[:3], [12] * 3) > two
    bounded = make(tiny_llama_dir, kv_budget_gib=two / GIB)
    results = together(bounded, [req(c, seed=i) for i, c in enumerate(contents)])
    assert all(r.ok for r in results)
    assert bounded.stats["max_batch_rows"] == 2 and bounded.stats["batches"] == 3
    assert tokens(results) == tokens(reference)


def test_a_row_over_the_budget_alone_is_refused_not_truncated(tiny_llama_dir):
    shape = make(tiny_llama_dir).cost
    backend = make(tiny_llama_dir, kv_budget_gib=batch_bytes(shape, [200], [16]) / GIB)
    long, short = req("a very long report " * 80, max_tokens=16), req("hi", max_tokens=16)
    res_long, res_short = together(backend, [long, short])
    assert res_short.ok
    assert not res_long.ok and res_long.prompt_tokens > 200
    assert f"{res_long.prompt_tokens} prompt tokens" in res_long.error
    assert "budget" in res_long.error and "vllm" in res_long.error


# ---------------------------------------------------------------- out of memory
def _oom_above(monkeypatch, k, also=None):
    """decode_batch that decodes (so rows carry state), then raises OOM for batches of more than
    `k` rows, or containing a row `also` picks."""
    real = hf_decode.decode_batch
    sizes = []

    def flaky(backend, rows):
        sizes.append(len(rows))
        out = real(backend, rows)
        if len(rows) > k or (also is not None and any(also(r) for r in rows)):
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return out

    monkeypatch.setattr(hf_decode, "decode_batch", flaky)
    return sizes


def test_out_of_memory_splits_the_batch_and_keeps_every_rows_output(tiny_llama_dir, monkeypatch):
    requests = [req(f"prompt {i} " + "text " * (3 * i), max_tokens=10 + i, seed=i) for i in range(5)]
    requests += [req("pick two answers", n=2, seed=9), req("status as JSON", max_tokens=30, seed=4, schema=SCHEMA)]
    unsplit, backend = make(tiny_llama_dir), make(tiny_llama_dir)
    for b in (unsplit, backend):
        b.grammar_for(SCHEMA)  # compiled now, so every request is queued at once
    reference = together(unsplit, requests)
    assert all(r.ok for r in reference) and unsplit.stats["batches"] == 1
    sizes = _oom_above(monkeypatch, 2)
    results = together(backend, requests)
    assert all(r.ok for r in results), [r.error for r in results]
    assert tokens(results) == tokens(reference)
    assert sizes[:3] == [8, 4, 2] and max(sizes[1:]) <= 4 and backend.stats["oom_splits"] == 3


def test_a_row_out_of_memory_alone_fails_only_its_request(tiny_llama_dir, monkeypatch):
    requests = [req("fine " * k, seed=k) for k in (1, 2, 3)] + [req("the doomed one " * 30, seed=7)]
    reference = together(make(tiny_llama_dir), requests)
    backend = make(tiny_llama_dir)
    _oom_above(monkeypatch, 99, also=lambda r: len(r.prompt_ids) > 60)
    results = together(backend, requests)
    assert [r.ok for r in results] == [True, True, True, False]
    assert "out of memory" in results[3].error and f"{results[3].prompt_tokens} prompt tokens" in results[3].error
    assert "vllm" in results[3].error
    assert tokens(results[:3]) == tokens(reference[:3])
    assert backend.stats["oom_rows_failed"] == 1


# ---------------------------------------------------------------- device (M6, M7)
def test_device_resolution_honours_cuda_n():
    assert resolve_device("cpu", 0) == "cpu" and resolve_device("auto", 0) == "cpu"
    assert resolve_device("auto", 2) == "cuda:0" and resolve_device("cuda", 2) == "cuda:0"
    assert resolve_device("cuda:1", 2) == "cuda:1"
    with pytest.raises(BackendError, match=r"cuda:3.*only 2 CUDA device"):
        resolve_device("cuda:3", 2, "m")
    with pytest.raises(BackendError, match="not available"):
        resolve_device("cuda:0", 0)
    with pytest.raises(BackendError, match="allowed: auto, cpu, cuda, cuda:N"):
        resolve_device("gpu1", 2)
    ctx = device_context("cuda:1")
    assert isinstance(ctx, torch.cuda.device) and ctx.idx == 1


def test_free_memory_is_measured_on_the_models_device(monkeypatch):
    seen = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: seen.append(d) or (5 * GIB, 8 * GIB))
    assert free_memory("cuda:1") == (5 * GIB, 8 * GIB)
    assert seen == [torch.device("cuda:1")]
    free, total = free_memory("cpu")
    assert total is None and (free is None or free > 0)


def test_decode_runs_under_the_models_device_in_the_worker_thread(tiny_llama_dir, monkeypatch):
    import rollouts.hf.backend as hf_backend

    entered = []
    real = hf_backend.device_context

    def spy(device):
        entered.append((device, threading.current_thread() is threading.main_thread()))
        return real(device)

    monkeypatch.setattr(hf_backend, "device_context", spy)
    backend = make(tiny_llama_dir)
    assert together(backend, [req("hello")])[0].ok
    assert entered == [("cpu", False)]


def test_bitmask_falls_back_to_torch_native_when_triton_cannot_run(tiny_llama_dir, caplog):
    """On CUDA the backend asks xgrammar for its Triton kernel; where Triton cannot run (here: CPU
    tensors; on a node: no C compiler) it switches to xgrammar's torch-native kernel, same output."""
    import json

    requests = [req(f"status {i} as JSON", max_tokens=40, seed=i, schema=SCHEMA) for i in range(3)]
    requests.append(req("free text row", seed=5))
    reference = together(make(tiny_llama_dir), requests)
    backend = make(tiny_llama_dir)
    backend.grammar_for(SCHEMA)
    backend.bitmask_kernel = "triton"
    with caplog.at_level(logging.WARNING, logger="rollouts.hf.sampling"):
        results = together(backend, requests)
    assert backend.bitmask_kernel == "torch_native"
    assert sum("torch-native" in m for m in caplog.messages) == 1
    assert tokens(results) == tokens(reference)
    for r in results[:3]:
        assert set(json.loads(r.text)) == {"status", "ok"}
