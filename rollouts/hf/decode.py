"""One batched decode, in the backend's worker thread.

Our own loop (`decode_loop`): each distinct prompt prefilled alone (no padding or mask: the fast
causal path on CPU), its keys/values copied into one left-padded cache (`kv_buffer.py`), the rows
decoded one token per step together; prefill starts from the prefix cache (`prefix_cache.py`,
`_remember`). Models not all full attention decode with one `model.generate` (`decode_generate`),
with the same sampler. docs/benchmark.md, "Inside the `hf` backend"; measurements in
docs/performance.md."""
from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from transformers import DynamicCache, GenerationConfig, LogitsProcessorList
from transformers.cache_utils import CacheLayerMixin

from rollouts.hf.device import release_cached
from rollouts.hf.kv_buffer import BufferLayer
from rollouts.hf.memory_plan import gib
from rollouts.hf.rows import Row
from rollouts.hf.sampling import RowSampler

if TYPE_CHECKING:
    from rollouts.hf.backend import HFBackend

# Batched decode: finished rows are dropped from the batch once they are this share of it (0: at
# once; measured on 16 rows of 3-7k tokens with budgets 16-200, decode time 0.76 s dropping at
# once, 0.79 s at half, 1.19 s never), and the cache and mask grow by this many columns at a time.
_COMPACT_FRACTION = 0.0
_CAPACITY_STEP = 256
# A prefill that continues a cached prefix runs attention with an explicit mask (the new tokens
# see all of the prefix, and each other causally), which on CPU takes sdpa's masked path: ~3.5x
# slower per query/key pair than the causal kernel a full prefill uses. Measured on the tiny
# Llama (benchmarks/rollout_throughput.py machine), continuing P cached tokens with q new ones
# beats a full prefill once q <= P/2: (P, q) = (4000, 400) 20 ms vs 68 ms, (3000, 1000) 41 vs
# 57 ms, (2000, 2000) 84 vs 58 ms, (300, 7000) 646 vs 167 ms. On CPU a shorter match is ignored.
_CPU_REUSE_MAX_NEW_PER_CACHED = 0.5


def decode_rows(backend: HFBackend, rows: list[Row]) -> str | None:
    """`decode_batch`, and on an out-of-memory error the batch again in two halves (shorter
    prompts in one, longer in the other), recursively; a row that runs out of memory alone gets
    its own error and the others still finish. Every row's sampler restarts from its seed on a
    retry (`RowSampler`), and a row's tokens do not depend on its batch, so a split changes no
    output. Between tries the prefix cache is emptied and the allocator's cache released."""
    try:
        return decode_batch(backend, rows)
    except torch.OutOfMemoryError:
        pass  # retry outside the handler: its traceback still holds the failed attempt's tensors
    with backend._run_lock:
        backend.prefix_cache.clear()
    release_cached(backend.device)
    if backend._closed:
        return "backend closed during generation"
    if len(rows) == 1:
        r = rows[0]
        backend.stats["oom_rows_failed"] += 1
        r.error = (f"out of memory on {backend.device} decoding this row alone: {len(r.prompt_ids)} prompt tokens "
                   f"plus up to {r.max_tokens} new (batch budget {gib(backend.budget.batch)}); lower "
                   "kv_budget_gib or max_tokens, or serve long contexts with the vllm backend")
        return None
    backend.stats["oom_splits"] += 1
    ordered = sorted(rows, key=lambda r: len(r.prompt_ids))
    half = len(ordered) // 2
    first = decode_rows(backend, ordered[:half])
    return decode_rows(backend, ordered[half:]) or first


def decode_batch(backend: HFBackend, rows: list[Row]) -> str | None:
    """Decode `rows` together (one batch at a time: the backend's run lock): select their LoRA
    adapter, run our loop or the `model.generate` fallback, count the batch in `backend.stats`.
    Fills each row's tokens and finish; returns the batch's error, or None."""
    with backend._run_lock:
        if any(r.grammar is not None for r in rows):
            backend._ensure_xgrammar()
        sampler = RowSampler(backend, rows)
        adapter = rows[0].adapter
        ctx: Any = contextlib.nullcontext()
        if backend.spec.adapters:
            if adapter is None:
                ctx = backend.model.disable_adapter()
            else:
                backend.model.set_adapter(adapter)
        with torch.inference_mode(), ctx:
            if backend._own_loop:
                steps = decode_loop(backend, rows, sampler)
            else:
                steps = decode_generate(backend, rows, sampler)
        backend.batches_run += 1
        st = backend.stats
        st["batches"] += 1
        st["loop_batches" if backend._own_loop else "generate_batches"] += 1
        st["rows"] += len(rows)
        st["max_batch_rows"] = max(st["max_batch_rows"], len(rows))
        st["decode_steps"] += steps
        st["json_rows"] += sum(r.grammar is not None for r in rows)
        st["json_cut_rows"] += sum(r.grammar is not None and r.finish == "length" for r in rows)
    return "backend closed during generation" if sampler.interrupted else None


def decode_loop(backend: HFBackend, rows: list[Row], sampler: RowSampler) -> int:
    """Our own decode loop (see module doc); returns the number of decode steps.

    1. Prefill: every distinct prompt alone (batch 1, no padding, no mask: the causal fast
       path), into a DynamicCache; its keys/values are copied into the batched buffers,
       left-padded to the longest prompt (rows of an n>1 request share the prefill).
    2. Decode: one forward per step for the rows still running, with a padding mask and
       per-row position ids continuing each row's own length; the sampler picks the tokens.
    3. Rows that finish are dropped from the batch (and leading columns that are padding for
       every remaining row) once they are `_COMPACT_FRACTION` of it."""
    model, dev = backend.model, backend.device
    cache_arg = backend.cache_arg  # `cache` (transformers >= 5.24) or `past_key_values` (earlier 5.x)
    assert cache_arg is not None  # _own_loop requires one
    adapter = rows[0].adapter
    n = len(rows)
    lens = [len(r.prompt_ids) for r in rows]
    width = max(lens)
    capacity = width + min(max(r.max_tokens for r in rows), _CAPACITY_STEP) + 1
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, r in enumerate(rows):
        groups.setdefault(tuple(r.prompt_ids), []).append(i)
    first: list[Any] = [None] * n
    bufs: list[tuple[Any, Any]] = []
    for prompt, members in groups.items():
        if backend._closed:  # aclose() during a long prefill
            sampler.interrupted = True
            for r in rows:
                r.finish = "length"
            return 0
        t0 = time.perf_counter()
        pre = DynamicCache()
        reused, past = backend.prefix_cache.lookup(adapter, prompt, limit=len(prompt) - 1)
        if reused and backend.device == "cpu" and len(prompt) - reused > _CPU_REUSE_MAX_NEW_PER_CACHED * reused:
            reused, past = 0, None
            backend.stats["prefix_matches_ignored"] += 1
        for li, (k, v) in enumerate(past or []):
            pre.update(k, v, li)
        rows[members[0]].pending.cached_tokens = reused
        out = model(input_ids=torch.tensor([prompt[reused:]], dtype=torch.long, device=dev),
                    use_cache=True, logits_to_keep=1, **{cache_arg: pre})
        backend.stats["prefill_tokens"] += len(prompt) - reused
        backend.stats["prefix_reused_tokens"] += reused
        prefilled = _prefilled(pre)
        backend.prefix_cache.insert(adapter, prompt, prefilled)
        lo = width - len(prompt)
        for li, (k, v) in enumerate(prefilled):
            if li == len(bufs):  # zeros: masked padding must not hold NaNs (0 * NaN in attention)
                bufs.append((k.new_zeros((n, k.shape[1], capacity, k.shape[3])),
                             v.new_zeros((n, v.shape[1], capacity, v.shape[3]))))
            for i in members:
                bufs[li][0][i, :, lo:width] = k[0]
                bufs[li][1][i, :, lo:width] = v[0]
        logits = out.logits[0, -1]
        for i in members:
            first[i] = logits
        del pre, out
        backend.timings["prefill_s"] += time.perf_counter() - t0
    cache = DynamicCache()
    buffer_layers = [BufferLayer(kb, vb, width) for kb, vb in bufs]
    cache.layers = list(buffer_layers)
    mask = torch.zeros((n, capacity), dtype=torch.bool)
    for i, m in enumerate(lens):
        mask[i, width - m:width] = True
    mask = mask.to(dev)
    position = torch.tensor(lens, dtype=torch.long, device=dev).unsqueeze(1)  # of the next token fed
    active = list(range(n))  # batch position -> row index
    pad_start = [width - m for m in lens]  # per row: its first real column
    length = width  # columns filled
    scores = torch.stack(first)
    del first
    steps = 0
    timings = backend.timings
    while True:
        t0 = time.perf_counter()
        feed = sampler.step(scores, active, steps)
        timings["sample_s"] += time.perf_counter() - t0
        steps += 1
        sampler.expire(steps)
        live = [p for p, a in enumerate(active) if rows[a].finish is None]
        if not live:
            _remember(backend, rows, buffer_layers, active, range(len(active)), pad_start, length)
            return steps
        if len(active) - len(live) >= max(1.0, _COMPACT_FRACTION * len(active)):
            done = [p for p, a in enumerate(active) if rows[a].finish is not None]
            _remember(backend, rows, buffer_layers, active, done, pad_start, length)
            start = min(pad_start[active[p]] for p in live)
            index = torch.tensor(live, dtype=torch.long, device=dev)
            for layer in buffer_layers:
                layer.keep(index, start)
            mask, position = mask[index, start:], position[index]
            active, feed = [active[p] for p in live], [feed[p] for p in live]
            for a in active:
                pad_start[a] -= start
            length -= start
        if length >= mask.shape[1]:
            mask = torch.cat([mask, mask.new_zeros((mask.shape[0], _CAPACITY_STEP))], dim=1)
            for layer in buffer_layers:
                layer.reserve(length + _CAPACITY_STEP)
        mask[:, length] = True
        length += 1
        t0 = time.perf_counter()
        out = model(input_ids=torch.tensor(feed, dtype=torch.long, device=dev).unsqueeze(1),
                    attention_mask=mask[:, :length], position_ids=position, use_cache=True,
                    **{cache_arg: cache})
        position += 1
        scores = out.logits[:, -1]
        timings["forward_s"] += time.perf_counter() - t0


def _prefilled(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's keys and values after a prefill (a full-attention cache fills both)."""
    kv = []
    for layer in cache.layers:
        keys, values = (layer.keys, layer.values) if isinstance(layer, CacheLayerMixin) else (None, None)
        if keys is None or values is None:
            raise RuntimeError(f"prefill left cache layer {type(layer).__name__} without keys/values")
        kv.append((keys, values))
    return kv


def _remember(backend: HFBackend, rows: list[Row], layers: list[BufferLayer], active: list[int],
              positions: Iterable[int], pad_start: list[int], length: int) -> None:
    """Put the keys/values of finished rows (prompt plus the generated tokens fed so far) in
    the prefix cache: the next prompt of a conversation usually continues this answer. Only
    for n=1 requests (best-of-n siblings are rarely continued; their prompt is cached)."""
    if backend.prefix_cache.max_bytes == 0:
        return
    for p in positions:
        r = rows[active[p]]
        if r.pending.request.sampling.n != 1:
            continue
        start = pad_start[active[p]]
        fed = min(length - start - len(r.prompt_ids), len(r.tokens))
        if fed <= 0:
            continue
        end = start + len(r.prompt_ids) + fed
        kv = [(layer.kbuf[p:p + 1, :, start:end].clone(), layer.vbuf[p:p + 1, :, start:end].clone())
              for layer in layers]
        backend.prefix_cache.insert(r.adapter, list(r.prompt_ids) + r.tokens[:fed], kv)


def decode_generate(backend: HFBackend, rows: list[Row], sampler: RowSampler) -> int:
    """Fallback for models whose cache is not plain full attention (sliding-window, linear
    attention layers): one left-padded `model.generate` with the sampler as its logits
    processor. Returns the number of decode steps."""
    width = max(len(r.prompt_ids) for r in rows)
    input_ids = torch.full((len(rows), width), backend.pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r.prompt_ids)
        input_ids[i, width - n:] = torch.tensor(r.prompt_ids, dtype=torch.long)
        attention[i, width - n:] = 1
    sampler.prompt_width = width
    gen_cfg = GenerationConfig(
        max_new_tokens=max(r.max_tokens for r in rows), do_sample=False, num_beams=1,
        eos_token_id=backend.stop_ids, pad_token_id=backend.pad_id)
    out = backend.model.generate(
        input_ids=input_ids.to(backend.device), attention_mask=attention.to(backend.device),
        generation_config=gen_cfg, logits_processor=LogitsProcessorList([sampler]))
    return int(out.shape[1] - width)
