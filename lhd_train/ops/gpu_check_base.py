"""What the checks of `lhd_train.ops.gpu_check` share: the context (device, scratch folder,
models built once), the outcome type, output helpers and a JSON-constrained request run."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pydantic import BaseModel

STATUSES = ("PASS", "FAIL", "SKIP")
Outcome = tuple[str, str]  # (status, detail)
log = logging.getLogger(__name__)


def proj(text: str) -> None:
    """A projection to the real model, logged (`lhd gpu-check` shows it as a `PROJ` line on stdout)."""
    log.info("PROJ %s", text)


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


class Ctx:
    """What the checks share: the device, a scratch folder, and models built once."""

    def __init__(self, device: str, work: Path, small: bool):
        self.device = device
        self.work = work
        self.small = small
        self.model_dir: Path | None = None  # the tiny Llama
        self.slice_dir: Path | None = None  # the 8B-shaped slice (gpu_check_slice.py)
        self.adapters: list[Path] = []

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def dtype(self) -> str:
        return "bfloat16" if self.cuda else "float32"

    def gpus(self) -> int:
        import torch

        return torch.cuda.device_count() if self.cuda and torch.cuda.is_available() else 0

    def reset_peak(self) -> int:
        """Start a peak measurement on the device; returns the bytes allocated now (0 on CPU)."""
        import torch

        if not self.cuda:
            return 0
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        return torch.cuda.memory_allocated(self.device)

    def peak_since(self, base: int) -> int:
        import torch

        if not self.cuda:
            return 0
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device) - base


def verdict_schema() -> type[BaseModel]:
    """A schema whose every document is short (no free text, no unbounded number): a random model
    completes it within a few dozen tokens, so an invalid answer is the backend's fault (the hf
    backend never invents a closing value at the token limit, it returns the answer cut)."""
    from typing import Literal

    from pydantic import BaseModel, Field

    class Verdict(BaseModel):
        deceptive: bool
        severity: int = Field(ge=0, le=4)
        label: Literal["FALSIFICATION", "CONCEALMENT", "EQUIVOCATION"]

    return Verdict


def json_run(backend: Any, n: int, messages: Callable[[int], list[dict[str, str]]], max_tokens: int,
             every: int = 1) -> tuple[list[str], float]:
    """`n` concurrent requests (every `every`-th JSON-constrained) through `backend`, closed after;
    returns the problems (failed requests, JSON that does not validate) and the seconds taken."""
    from rollouts.structured import parse_json_output, schema_for
    from rollouts.types import GenerationRequest, SamplingParams

    Verdict = verdict_schema()
    schema = schema_for(Verdict)
    reqs = [GenerationRequest(messages(i), SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=100 + i),
                              schema if i % every == 0 else None) for i in range(n)]

    async def go():
        try:
            return [r for (r,) in await asyncio.gather(*(backend.generate([q]) for q in reqs))]
        finally:
            await backend.aclose()

    t0 = time.perf_counter()
    results = asyncio.run(go())
    bad = []
    for i, (q, r) in enumerate(zip(reqs, results, strict=True)):
        if not r.ok:
            bad.append(f"#{i}: {r.error}")
        elif q.json_schema is not None and parse_json_output(r.text, Verdict)[1] is not None:
            bad.append(f"#{i}: not valid JSON for the schema: {r.text[:80]!r}")
    return bad, time.perf_counter() - t0
