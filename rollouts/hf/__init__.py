"""`hf` backend: transformers in-process, batched across concurrent callers, per-row sampling,
JSON-schema constrained decoding with xgrammar. CPU-capable (tests, tiny demo, lens).

`spec.py` (the model entry, `HFSpec`) imports no torch, so configs load without it; the other
modules import torch, transformers and xgrammar at module level, when a backend is built.

  spec.py          `HFSpec`: the entry's fields, GPUs, and `build`
  backend.py       `HFBackend`: construction, tokens, grammars, the request queue and worker
  rows.py          a request (`Pending`) and its n rows (`Row`): the unit of work
  batching.py      when the worker starts the next batch (waits for the senders of the last one)
  decode.py        one batched decode: our own loop over a left-padded cache, or `model.generate`;
                   an out-of-memory batch split in halves and retried
  memory_plan.py   bytes per token and per batch from the model config, the budgets, row admission
  device.py        `device` resolved to cpu or cuda:N, the worker thread's CUDA device, free memory
  kv_buffer.py     that loop's preallocated key/value buffers (a transformers `DynamicLayer`)
  prefix_cache.py  keys/values reused across requests (what vLLM's prefix caching does)
  sampling.py      the per-row sampler: repetition penalty, temperature, top-k, top-p, seeded generators
  json_guard.py    grammar-constrained rows: the schema as a token mask, never forced closing
"""
from typing import Any


def __getattr__(name: str) -> Any:
    """`from rollouts.hf import HFBackend` imports torch only then."""
    if name == "HFBackend":
        from rollouts.hf.backend import HFBackend

        return HFBackend
    raise AttributeError(name)
