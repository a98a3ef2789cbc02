"""`backend: hf`: what its model entry holds, and what the in-process backend answers about itself.
Imports no torch: configs load without it; `build` imports the backend."""
from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field

from rollouts.gpus import GpuClaim, hf_position
from rollouts.spec import LoadsAdapters

if TYPE_CHECKING:
    from rollouts.backend import Backend


class HFSpec(LoadsAdapters):
    """transformers in this process: batched across concurrent callers (rollouts/hf/backend.py)."""

    backend: Literal["hf"] = "hf"
    dtype: str = Field("auto", description="auto | float32 | bfloat16 | float16")
    device: str = Field("auto", description="auto | cpu | cuda | cuda:N (auto: cuda when a GPU is visible)")
    max_batch_size: int = Field(16, ge=1, description="most sequences decoded together")
    batch_wait_ms: float = Field(5.0, ge=0, description="wait this long to fill a batch")
    enable_prefix_caching: bool = Field(
        True, description="reuse the keys/values of a prompt prefix computed by an earlier request")
    prefix_cache_gib: float | None = Field(
        None, ge=0, description="GiB of keys/values kept for reuse across requests; default: 2 on CPU, a fifth of "
        "the free memory on CUDA (an 8B Llama in bf16 needs 128 KiB per token: 8k tokens per GiB; the tiny test "
        "model 0.5 KiB)")
    kv_budget_gib: float | None = Field(
        None, gt=0, description="GiB one batch's keys/values and prefill may use (rows are admitted until it is "
        "full); default: the free GPU memory after loading less a margin and the prefix cache, on CPU the "
        "available memory (rollouts/hf/memory_plan.py)")

    in_process = True

    def build(self, name: str = "", log_dir: str | None = None) -> Backend:
        from rollouts.hf.backend import HFBackend

        return HFBackend.from_spec(self)

    def gpu_claim(self, cuda: bool) -> GpuClaim | None:
        device = ("cuda" if cuda else "cpu") if self.device == "auto" else self.device
        position = hf_position(device)
        return None if position is None else GpuClaim([position], "device", f"device: {self.device}")

    def placement(self, cuda: bool) -> str:
        return f"in-process transformers ({self.device}) {self.model}"
