"""What the device tests of tests/gpu/ share: peak-memory measurement, a JSON-constrained request
run through a backend, prompts of a given token length, and the installed versions against lhd's
ranges (pyproject.toml)."""
from __future__ import annotations

import asyncio
import re
import time
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pydantic import BaseModel

ROOT = Path(__file__).resolve().parents[2]
LLAMA_8B = ROOT / "configs" / "models" / "llama-3.1-8b-instruct" / "config.json"
WORDS = "region units sold price demand budget report plan week team venue risk status".split()
#: the distributions the device tests import, compared with lhd's ranges first
CHECKED = ("torch", "transformers", "tokenizers", "peft", "trl", "accelerate", "datasets", "safetensors",
           "xgrammar", "pydantic", "pyarrow", "pandas", "numpy", "bitsandbytes", "typer", "rich", "pyyaml")


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def is_cuda(device: str) -> bool:
    return device.startswith("cuda")


def dtype_of(device: str) -> str:
    return "bfloat16" if is_cuda(device) else "float32"


def reset_peak(device: str) -> int:
    """Start a peak measurement on the device; returns the bytes allocated now (0 on CPU)."""
    import torch

    if not is_cuda(device):
        return 0
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def peak_since(device: str, base: int) -> int:
    import torch

    if not is_cuda(device):
        return 0
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def sync(device: str) -> None:
    import torch

    if is_cuda(device):
        torch.cuda.synchronize(device)


def declared_ranges() -> dict[str, str]:
    """distribution (normalised) -> the specifier pyproject.toml declares (dependencies and `qlora`)."""
    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    reqs = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["qlora"]]
    return {normalise(r.name): str(r.specifier) for r in reqs}


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def range_report(ranges: dict[str, str]) -> list[tuple[str, str | None, str, bool]]:
    """(distribution, installed version or None, lhd's range, within it) for each checked distribution
    lhd declares. A local label (2.11.0+cu130) is compared without it, as pip does for `>=` and `<`.
    Why: on a node image lhd runs from its checkout next to the image's own packages, so pip never
    compared them with lhd's ranges."""
    import importlib.metadata as md

    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    out = []
    for name in CHECKED:
        spec = ranges.get(normalise(name))
        if spec is None:
            continue
        try:
            version: str | None = md.version(name)
        except md.PackageNotFoundError:
            version = None
        ok = version is not None and SpecifierSet(spec).contains(Version(version).public, prereleases=True)
        out.append((name, version, spec, ok))
    return out


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


def text_messages(backend: Any, tokens: int, i: int) -> list[dict[str, str]]:
    """A system and a user message of about `tokens` tokens (as `backend.count_tokens` counts them)."""
    def messages(n_words: int) -> list[dict[str, str]]:
        text = " ".join(f"{WORDS[(i * 7 + j * 3) % len(WORDS)]}{j % 97}" for j in range(n_words))
        return [{"role": "system", "content": "You audit."}, {"role": "user", "content": text}]

    per_word = backend.count_tokens(messages(200)) / 200
    return messages(max(1, int(tokens / per_word)))


def hf_backend(model: Path, device: str, **spec: Any) -> Any:
    """The hf backend on `model`, on `device` in its dtype, with the given spec fields."""
    from rollouts.hf import HFBackend
    from rollouts.hf.spec import HFSpec

    return HFBackend.from_spec(HFSpec(model=str(model), device=device, dtype=dtype_of(device),
                                         **spec))


#: spec-sheet memory bandwidth (bytes/s) by GPU name, the more specific names first
BANDWIDTHS = (("H200", 4.8e12), ("H100 NVL", 3.9e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12))


def bandwidth_of(name: str) -> float | None:
    """The bandwidth bound for the GPU called `name` (torch's device name), None when not known:
    a bound taken from another GPU would misstate every decode rate's share of it."""
    for key, value in BANDWIDTHS:
        if key.lower() in name.lower():
            return value
    return None


def lens_dim_batches(shape: Any, memory: int, sources: list[int], target: int, tokens: int,
                     wanted: tuple[int, ...] = (64, 128)) -> list[int]:
    """The dim batches of `wanted` whose lens plan fits a GPU of `memory` bytes (lens.plan's headroom),
    or, when none does, the largest the planner finds that fits: an H100 80GB runs 64 (55 GiB at 8B),
    an H200 also 128 (94 GiB)."""
    from lens.plan import plan_fit

    def plan(dim_batch: int | None) -> Any:
        return plan_fit(shape, dtype="bfloat16", attn="sdpa", sources=sources, target=target, tokens=tokens,
                        dim_batch=dim_batch, budget=memory, device_type="cuda")

    fitting = [b for b in wanted if plan(b).fits]
    return fitting or [plan(None).dim_batch]
