"""`hf` backend: transformers in-process, batched across concurrent callers, per-row sampling,
JSON-schema constrained decoding with xgrammar. CPU-capable (tests, tiny demo, lens).

`spec.py` (`HFSpec`) imports no torch, so configs load without it; the other modules import torch,
transformers and xgrammar when a backend is built. The modules and how a call flows through them:
docs/benchmark.md, "Inside the `hf` backend"."""
from typing import Any


def __getattr__(name: str) -> Any:
    """`from rollouts.hf import HFBackend` imports torch only then."""
    if name == "HFBackend":
        from rollouts.hf.backend import HFBackend

        return HFBackend
    raise AttributeError(name)
