"""What a lens fit will cost, from the model's `config.json` alone, and the defaults derived from it.

An 8B fit with a CPU test's settings needs about 100 GiB of GPU memory and a fit runs for hours, so
the plan says before any weight is loaded whether the settings fit a memory budget, picks
`dim_batch` from it and estimates the time per prompt. Peak device memory per prompt: weights,
saved activations (`activation_bytes_per_token`, checked against autograd in tests/lens/test_plan.py),
hooked block outputs, the per-prompt estimate, source-layer gradients and a backward working set;
the running sums live in host memory. docs/lens.md, "Planning a fit on a GPU"."""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lens.errors import LensError
from lens.model import parse_dtype
from rollouts.backend import BackendError
from rollouts.model_config import ModelShape as Shape
from rollouts.model_config import read_config

GiB = 1024**3
DIM_BATCHES = (128, 64, 32, 16, 8, 4, 2, 1)  # candidates for an automatic dim_batch, largest first
DEFAULT_DIM_BATCH = 64  # without a memory budget (CPU): the reference's value
HEADROOM = 0.9  # a plan fits when its peak is at most this share of the budget (allocator, CUDA context)
# Sustained throughput assumed for the time estimate, TFLOP/s, by (device type, bytes per element):
# bf16 on an H100/H200 at roughly 40 % of its dense peak; fp32 on CUDA runs without TF32 (torch's
# default); CPU values are for a many-core server. Override with --tflops.
ASSUMED_TFLOPS = {("cuda", 2): 300.0, ("cuda", 4): 40.0, ("cpu", 2): 0.2, ("cpu", 4): 0.5}


def resolve_dtype(dtype: str, device: torch.device | str) -> str:
    """`auto` is bfloat16 on a CUDA device (an 8B fit in fp32 does not fit 80 GB) and float32 elsewhere."""
    if dtype == "auto":
        return "bfloat16" if torch.device(device).type == "cuda" else "float32"
    return str(parse_dtype(dtype)).removeprefix("torch.")


def resolve_attn(attn: str, method: str) -> str:
    """`auto` is sdpa for the replicate method and eager for vmap.

    The fit takes first-order gradients only (no double backward), and its hooks sit on block
    outputs, so sdpa computes the same lens as eager (tests/lens/test_plan.py) without keeping the
    `[heads, T, T]` scores. `method="vmap"` batches the backward with `is_grads_batched`, and torch
    has no batching rule for the sdpa backward kernels (`_scaled_dot_product_*_backward`): each
    would run once per direction, so vmap keeps eager attention, whose ops all have one.
    """
    if attn != "auto":
        return attn
    return "eager" if method == "vmap" else "sdpa"


class ModelShape(Shape):
    """`rollouts.model_config.ModelShape` (the one reader of a model's config), refusing in lens's
    own error what the plan cannot cost: a config without the sizes, or a mixture of experts."""

    @classmethod
    def parse(cls, cfg: Mapping[str, Any] | Any, source: str = "config.json") -> ModelShape:
        try:
            shape = super().parse(cfg, source)
        except BackendError as exc:
            raise LensError(str(exc)) from None
        if shape.experts:
            raise LensError(f"{source}: a mixture-of-experts config; the lens plan covers dense models only")
        if not shape.vocab:
            raise LensError(f"{source}: field 'vocab_size' is missing; the lens plan needs a positive integer")
        return shape

    @classmethod
    def read(cls, model: str, revision: str | None = None) -> ModelShape:
        """The shape of a local model folder, or of a hub id already in the Hugging Face cache (no download):
        `config.json` alone, read by rollouts' one reader (`rollouts.model_config.read_config`)."""
        try:
            cfg = read_config(model, revision)
        except BackendError as exc:
            raise LensError(str(exc)) from None
        return cls.parse(cfg, source=f"{model} (config.json)")


def dtype_bytes(dtype: str) -> int:
    return parse_dtype(dtype).itemsize


def activation_bytes_per_token(shape: ModelShape, dtype: str, attn: str, tokens: int) -> float:
    """Bytes autograd saves per token per block when only inputs need gradients (parameters frozen).

    Linear layers then save no input (the weight is all the input's gradient needs), so what is
    left is: each RMSNorm's fp32 copy of its input and its `rsqrt` (whatever the model dtype), the
    per-head q/k norms of Qwen3, the MLP's gate, activation and up projections, and the attention:
    sdpa keeps q, k, v, its output and the log-sum-exp; eager keeps q and the repeated k and v
    plus the softmax (fp32) and its cast to the model dtype, `heads × keys` each.
    """
    s = dtype_bytes(dtype)
    d, q, kv = shape.d_model, shape.n_heads * shape.head_dim, shape.n_kv_heads * shape.head_dim
    total = 2 * (4 * d + 4) + 3 * shape.ffn * s
    if shape.qk_norm:
        total += 4 * (q + kv) + 4 * (shape.n_heads + shape.n_kv_heads)
    if attn == "eager":
        total += 3 * q * s + shape.n_heads * tokens * (4 + (s if s != 4 else 0))
    else:
        total += (2 * q + 2 * kv) * s + 4 * shape.n_heads
    return float(total)


@dataclass
class FitPlan:
    """The plan of one prompt: device memory by part (bytes), host memory, FLOPs, and the verdict."""

    shape: ModelShape
    dtype: str
    attn: str
    method: str
    device_type: str
    dim_batch: int
    dim_batch_auto: bool
    tokens: int
    sources: list[int]
    target: int
    k: int
    budget: int | None
    tflops: float
    flops: float
    memory: dict[str, int] = field(default_factory=dict)
    host: dict[str, int] = field(default_factory=dict)

    @property
    def activation_per_token(self) -> float:
        return activation_bytes_per_token(self.shape, self.dtype, self.attn, self.tokens)

    @property
    def peak(self) -> int:
        return sum(self.memory.values())

    @property
    def fits(self) -> bool | None:
        return None if self.budget is None else self.peak <= HEADROOM * self.budget

    @property
    def seconds_per_prompt(self) -> float:
        return self.flops / (self.tflops * 1e12)

    def lines(self) -> list[str]:
        """The plan as printed by `lhd lens fit --plan`."""
        auto = " (auto: the largest that fits the budget)" if self.dim_batch_auto and self.budget else (
            " (default; no memory budget)" if self.dim_batch_auto else "")
        out = [
            f"lens fit plan: {self.shape.describe()}",
            f"  blocks {self.sources[0]}..{self.sources[-1]} -> target {self.target} ({len(self.sources)} source "
            f"layers, {self.target - min(self.sources)} blocks in the graph), {self.tokens} tokens per prompt, "
            f"{self.dtype}, {self.attn} attention, {self.method}, device {self.device_type}",
            f"  dim_batch {self.dim_batch}{auto}",
            f"  device memory per prompt (GiB; activations {self.activation_per_token / self.shape.d_model:.1f} "
            "bytes x d per token per block):",
        ]
        out += [f"    {name:<34} {size / GiB:8.2f}" for name, size in self.memory.items()]
        verdict = "no budget given (--memory-gib)" if self.budget is None else (
            f"budget {self.budget / GiB:.1f} GiB, {HEADROOM:.0%} usable: "
            + ("fits" if self.fits else "DOES NOT FIT"))
        out.append(f"    {'peak (estimate)':<34} {self.peak / GiB:8.2f}   {verdict}")
        out.append("  host memory (GiB): " + ", ".join(f"{name} {size / GiB:.2f}" for name, size in self.host.items()))
        secs = self.seconds_per_prompt
        out.append(f"  per prompt: {self.flops / 1e15:.3g} PFLOP, about {_duration(secs)} at an assumed "
                   f"{self.tflops:g} TFLOP/s (--tflops); 100 prompts about {_duration(100 * secs)}")
        if self.fits is False:
            out.append("  to fit: " + self.advice())
        return out

    def advice(self) -> str:
        tips = []
        if self.dtype == "float32":
            tips.append("--dtype bfloat16")
        if self.dim_batch > 1:
            tips.append("a smaller --dim-batch (or leave it out to pick one)")
        if self.attn == "eager" and self.method == "replicate":
            tips.append("--attn sdpa")
        tips.append("fewer --source-layers")
        return ", ".join(tips)


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.3g} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.3g} min"
    return f"{seconds / 3600:.3g} h"


def _build(shape: ModelShape, *, dtype: str, attn: str, method: str, device_type: str, dim_batch: int,
           dim_batch_auto: bool, tokens: int, sources: list[int], target: int, k: int, budget: int | None,
           tflops: float | None) -> FitPlan:
    s = dtype_bytes(dtype)
    d, T, B = shape.d_model, tokens, dim_batch
    n_src = len(sources)
    graph = target - min(sources)  # blocks root+1..target are differentiated
    fwd_seqs = B if method == "replicate" else 1
    fwd_rows = fwd_seqs * T
    per_token = activation_bytes_per_token(shape, dtype, attn, T)  # eager's share grows with T
    held = 1 + (n_src if s != 4 else 0)  # the target output, and in bf16/fp16 every source output
    working = B * T * (4 * shape.ffn + 6 * d) * s
    if attn == "eager":
        working += B * shape.n_heads * T * T * (8 + s)
    memory = {
        "weights": shape.n_params * s,
        "saved activations": int(fwd_rows * graph * per_token),
        "block outputs held by the hooks": held * fwd_rows * d * s,
        "per-prompt J (out, fp32)": n_src * k * d * 4,
        "source-layer gradients": n_src * B * T * d * s + B * T * d * 4,
        "backward working set": working,
    }
    matrix = n_src * k * d * 4
    host = {"running sums (2 x fp32)": 2 * matrix, "checkpoint file": 2 * matrix}
    if device_type == "cuda":
        host["pinned staging"] = matrix
    attn_flops = 4 * T * T * shape.n_heads * shape.head_dim  # QK^T and PV of one sequence in one block
    forward = fwd_rows * 2 * shape.block_params * (target + 1) + fwd_seqs * attn_flops * (target + 1)
    per_pass = B * T * 2 * shape.block_params * graph + B * 2 * attn_flops * graph  # input gradients only
    flops = forward + math.ceil(k / B) * per_pass
    rate = tflops if tflops is not None else ASSUMED_TFLOPS.get((device_type, s), ASSUMED_TFLOPS[("cpu", 4)])
    return FitPlan(shape=shape, dtype=dtype, attn=attn, method=method, device_type=device_type, dim_batch=B,
                   dim_batch_auto=dim_batch_auto, tokens=T, sources=list(sources), target=target, k=k, budget=budget,
                   tflops=rate, flops=float(flops), memory=memory, host=host)


def plan_fit(
    shape: ModelShape,
    *,
    dtype: str,
    attn: str,
    sources: Sequence[int],
    target: int,
    tokens: int = 128,
    method: str = "replicate",
    dim_batch: int | None = None,
    k: int | None = None,
    budget: int | None = None,
    device_type: str = "cuda",
    tflops: float | None = None,
) -> FitPlan:
    """Plan one prompt of a fit; `dim_batch=None` picks the largest candidate that fits `budget` (bytes).

    `sources`/`target` are resolved block indices (lens.fit.resolve_layers); `k` is the number of
    output directions (`d_model` for a full lens).
    """
    if not sources:
        raise LensError("the lens plan needs at least one source layer")
    k = shape.d_model if k is None else int(k)
    directions = k

    def build(batch: int, auto: bool) -> FitPlan:
        """The plan at one dim batch; everything else is this call's arguments."""
        return _build(shape, dtype=dtype, attn=attn, method=method, device_type=device_type, dim_batch=batch,
                      dim_batch_auto=auto, tokens=int(tokens), sources=sorted(sources), target=int(target),
                      k=directions, budget=budget, tflops=tflops)

    if dim_batch is not None:
        if dim_batch < 1:
            raise LensError(f"--dim-batch must be >= 1, got {dim_batch}")
        return build(int(dim_batch), auto=False)
    if budget is None:
        return build(min(DEFAULT_DIM_BATCH, k), auto=True)
    plan = None
    for B in DIM_BATCHES:
        if B > k and B != 1:
            continue
        plan = build(B, auto=True)
        if plan.fits:
            return plan
    assert plan is not None
    return plan  # dim_batch 1 and still too big: the caller reports it
