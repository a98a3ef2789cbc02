"""Memory arithmetic of the in-process `hf` backend: what one batch of rows costs, how much the
backend may spend on it, and which queued rows fit.

Why: our decode loop (`rollouts/hf/decode.py`) preallocates, per layer, a left-padded key/value
buffer of [rows, kv_heads, longest prompt + new tokens + 1, head_dim], and keeps one prompt's
prefill cache beside it. For Llama-3.1-8B in bf16 that is 128 KiB per token, so 16 rows of 32k
tokens need 64 GiB: without a bound a batch runs the GPU out of memory and fails every row.
Batches are therefore admitted against a byte budget computed here from the model's config.

Pure arithmetic (no torch): the backend passes in the free memory it measured.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rollouts.model_config import ModelShape

GIB = 2**30
# Held back from the measured free memory on CUDA: the CUDA context, cuBLAS workspaces, the
# allocator's fragmentation and the decode step's logits (2 GiB plus 5% of the GPU).
CUDA_MARGIN_BYTES = 2 * GIB
CUDA_MARGIN_SHARE = 0.05
# Share of the usable memory given to the prefix cache by default on CUDA (a fifth: an 8B model
# on an 80 GB GPU keeps ~90k tokens of earlier prompts for reuse).
PREFIX_SHARE = 0.2
# CPU defaults: the prefix cache keeps its historical 2 GiB; the batch budget is the memory the
# OS reports available, never below `CPU_MIN_BUDGET_BYTES` (a generous floor: on CPU an
# overcommit is slow, not fatal, and tiny test models need kilobytes).
CPU_PREFIX_BYTES = 2 * GIB
CPU_MIN_BUDGET_BYTES = 4 * GIB
CPU_FALLBACK_BYTES = 64 * GIB  # when the available memory cannot be read


@dataclass(frozen=True)
class TokenCost:
    """Bytes per token of one model in one dtype: its keys/values in every layer, and one layer's
    prefill activations (`ModelShape`)."""

    kv: int
    prefill: int

    @classmethod
    def of(cls, shape: ModelShape, dtype_bytes: int) -> TokenCost:
        return cls(shape.kv_bytes_per_token(dtype_bytes), shape.prefill_bytes_per_token(dtype_bytes))


def batch_bytes(cost: TokenCost, prompt_lens: Sequence[int], max_new: Sequence[int]) -> int:
    """Peak bytes of one batch in our decode loop: the batched buffers hold every row at the
    longest prompt's width plus the most new tokens (+1 column), one prompt's prefill cache is
    alive beside them, and the longest prefill's activations come on top."""
    if not prompt_lens:
        return 0
    width, new = max(prompt_lens), max(max_new)
    tokens = len(prompt_lens) * (width + new + 1) + width
    return cost.kv * tokens + cost.prefill * width


def admit(cost: TokenCost, budget: int, rows: Sequence[tuple[int, int]], max_rows: int) -> list[int]:
    """Indices of `rows` ((prompt length, max new tokens) each) that form the next batch: the
    first row always (it is the oldest; a row that alone exceeds the budget is refused before it
    is queued), then the others in order of prompt length, each while the batch still fits
    `budget` and has fewer than `max_rows` rows."""
    if not rows:
        return []
    chosen = [0]
    lens, news = [rows[0][0]], [rows[0][1]]
    for i in sorted(range(1, len(rows)), key=lambda i: rows[i][0]):
        if len(chosen) >= max_rows:
            break
        plen, new = rows[i]
        if batch_bytes(cost, lens + [plen], news + [new]) <= budget:
            chosen.append(i)
            lens.append(plen)
            news.append(new)
    return chosen


@dataclass(frozen=True)
class Budget:
    """Bytes the backend may spend: on one batch (`batch`) and on the prefix cache (`prefix`)."""

    batch: int
    prefix: int
    source: str  # how `batch` was chosen, for error messages and describe()


def plan_budget(device_type: str, free: int | None, total: int | None, kv_budget_gib: float | None,
                prefix_cache_gib: float | None, prefix_enabled: bool) -> Budget:
    """The batch and prefix-cache budgets. `free`/`total`: device memory measured after the
    weights were loaded (CUDA), or the OS's available memory (CPU; total unused); None when
    unknown. Explicit options win; on CUDA the defaults split the free memory less a margin
    between the prefix cache (`PREFIX_SHARE`) and the batches; on CPU the prefix cache keeps 2 GiB
    and batches get what is available."""
    if device_type == "cuda":
        usable = max(0, (free or 0) - CUDA_MARGIN_BYTES - int(CUDA_MARGIN_SHARE * (total or 0)))
        default_prefix = int(PREFIX_SHARE * usable)
    else:
        usable = CPU_FALLBACK_BYTES if free is None else free
        default_prefix = CPU_PREFIX_BYTES
    if not prefix_enabled:
        prefix = 0
    elif prefix_cache_gib is not None:
        prefix = int(prefix_cache_gib * GIB)
    else:
        prefix = default_prefix
    if kv_budget_gib is not None:
        return Budget(int(kv_budget_gib * GIB), prefix, "kv_budget_gib")
    if device_type == "cuda":
        return Budget(max(0, usable - prefix), prefix,
                      f"free GPU memory after loading ({(free or 0) / GIB:.1f} GiB) less a safety margin "
                      f"and the prefix cache")
    return Budget(max(CPU_MIN_BUDGET_BYTES, usable - prefix), prefix, "available memory less the prefix cache")


def gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"
