"""Activation steering for the in-process `hf` backend: while `steering(...)` is active, every
prompt the backend prefills gets `alpha * |h| * unit(vector)` added to one decoder block's output
at its last token (the position whose next-token distribution starts the answer), where `|h|` is
that position's residual norm. Generated tokens are not steered; they attend to the steered
position's keys and values.

The prefix cache is off meanwhile: a steered key/value must never be reused by an unsteered
request (nor the reverse), and without cached prefixes every prefill is the whole prompt, so a
forward of more than one token is a prefill and its last token the prompt's last (one token per
row is a decode step; left padding in the `model.generate` fallback keeps the prompt's last
token last). Requests made while steering must all want it: one backend, one steering at a time."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from rollouts.hf.prefix_cache import PrefixCache


def _residual(output: Any) -> tuple[torch.Tensor, Any]:
    if isinstance(output, torch.Tensor):
        return output, None
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0], tuple(output[1:])
    raise TypeError(f"cannot find the residual stream in a block output of type {type(output).__name__}")


@contextlib.contextmanager
def steering(backend: Any, block: torch.nn.Module, vector: torch.Tensor, alpha: float) -> Iterator[dict[str, int]]:
    """Steer `backend` (an `HFBackend`) along `vector` at `block`'s output (module doc). Yields a
    counter of steered prefills (`{"prefills": n}`), so a caller can check the hook ran."""
    unit = (vector / vector.norm()).to(device=backend.device)
    counter = {"prefills": 0}

    def hook(_module: torch.nn.Module, _inputs: Any, output: Any) -> Any:
        h, rest = _residual(output)
        if h.shape[1] < 2 or alpha == 0:
            return None
        last = h[:, -1, :]
        h = h.clone()
        h[:, -1, :] = last + alpha * last.norm(dim=-1, keepdim=True) * unit.to(h.dtype)
        counter["prefills"] += h.shape[0]
        return h if rest is None else (h, *rest)

    with backend._run_lock:  # no batch is decoding while the cache is swapped
        saved, backend.prefix_cache = backend.prefix_cache, PrefixCache(0)
    handle = block.register_forward_hook(hook)
    try:
        yield counter
    finally:
        handle.remove()
        with backend._run_lock:
            backend.prefix_cache = saved
