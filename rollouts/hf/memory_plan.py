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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

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


def _get(cfg: Any, name: str) -> Any:
    return cfg.get(name) if isinstance(cfg, Mapping) else getattr(cfg, name, None)


def _text_config(cfg: Any) -> Any:
    if isinstance(cfg, Mapping):
        return cfg.get("text_config") or cfg
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder that set its memory per token."""

    layers: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    dtype_bytes: int

    @property
    def kv_bytes_per_token(self) -> int:
        """Keys and values of one token in every layer: 2 × layers × kv_heads × head_dim × dtype."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def prefill_bytes_per_token(self) -> int:
        """Transient tensors of one layer's forward per prompt token (an estimate: the MLP's gate,
        up and product, and ~6 hidden-sized tensors: residual, norm, q/k/v, attention output).
        Layers run one after another, so only one layer's activations are alive at a time."""
        return (3 * self.intermediate + 6 * self.hidden) * self.dtype_bytes


def model_shape(config: Any, dtype_bytes: int) -> ModelShape:
    """Read `ModelShape` from a transformers config (or a config.json dict). Handles grouped-query
    attention (`num_key_value_heads`, default: all heads) and an explicit `head_dim` that differs
    from hidden_size / heads (Qwen3, Gemma)."""
    cfg = _text_config(config)
    layers, heads, hidden = (_get(cfg, k) for k in ("num_hidden_layers", "num_attention_heads", "hidden_size"))
    if not (layers and heads and hidden):
        raise ValueError("model config lacks num_hidden_layers, num_attention_heads or hidden_size: "
                         "cannot size the hf backend's key/value memory")
    kv_heads = _get(cfg, "num_key_value_heads") or heads
    head_dim = _get(cfg, "head_dim") or hidden // heads
    intermediate = _get(cfg, "intermediate_size") or 4 * hidden
    return ModelShape(int(layers), int(kv_heads), int(head_dim), int(hidden), int(intermediate), int(dtype_bytes))


def batch_bytes(shape: ModelShape, prompt_lens: Sequence[int], max_new: Sequence[int]) -> int:
    """Peak bytes of one batch in our decode loop: the batched buffers hold every row at the
    longest prompt's width plus the most new tokens (+1 column), one prompt's prefill cache is
    alive beside them, and the longest prefill's activations come on top."""
    if not prompt_lens:
        return 0
    width, new = max(prompt_lens), max(max_new)
    tokens = len(prompt_lens) * (width + new + 1) + width
    return shape.kv_bytes_per_token * tokens + shape.prefill_bytes_per_token * width


def admit(shape: ModelShape, budget: int, rows: Sequence[tuple[int, int]], max_rows: int) -> list[int]:
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
        if batch_bytes(shape, lens + [plen], news + [new]) <= budget:
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
