"""`rollouts.hf.steering` on the tiny Llama: the hf backend's greedy answer under steering is the
one a plain forward loop gives when the vector is added at the last prompt token only, the
prefix cache is left as it was, and strength 0 changes nothing."""
from __future__ import annotations

import asyncio

import torch

from rollouts.hf import HFBackend
from rollouts.hf.spec import HFSpec
from rollouts.hf.steering import steering
from rollouts.types import GenerationRequest, SamplingParams

MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Report the churn rate of Acme with its source file, in one sentence."}]


def greedy(backend: HFBackend, n: int) -> list[int]:
    [res] = asyncio.run(backend.generate([GenerationRequest(MESSAGES, SamplingParams(temperature=0.0, max_tokens=n,
                                                                                   seed=0))]))
    assert res.ok, res.error
    return list(res.completions[0].token_ids or [])


def manual(model, prompt: list[int], block, vector: torch.Tensor, alpha: float, n: int, stops: set[int]) -> list[int]:
    """Greedy by full forwards, adding alpha*|h|*unit(v) at the prompt's last token only."""
    unit = vector / vector.norm()
    at = len(prompt) - 1

    def hook(_m, _i, out):
        h = out if isinstance(out, torch.Tensor) else out[0]
        h = h.clone()
        h[:, at] = h[:, at] + alpha * h[:, at].norm(dim=-1, keepdim=True) * unit
        return h if isinstance(out, torch.Tensor) else (h, *out[1:])

    handle = block.register_forward_hook(hook)
    ids = list(prompt)
    try:
        for _ in range(n):
            with torch.no_grad():
                nxt = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
            if nxt in stops:
                break
            ids.append(nxt)
    finally:
        handle.remove()
    return ids[len(prompt):]


def test_steering_adds_at_the_last_prompt_token_only(tiny_llama_dir):
    backend = HFBackend.from_spec(HFSpec(model=str(tiny_llama_dir), device="cpu"))
    block = backend.model.model.layers[0]
    prompt = backend.encode_chat(MESSAGES)
    v = torch.randn(backend.model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    plain = greedy(backend, 6)
    assert plain == manual(backend.model, prompt, block, v, 0.0, 6, backend.stop_set)
    cache_before = backend.prefix_cache
    entries = len(cache_before)
    with steering(backend, block, v, 0.0) as count:
        assert greedy(backend, 6) == plain and count["prefills"] == 0
    changed = False
    for alpha in (3.0, 8.0):
        with steering(backend, block, v, alpha) as count:
            steered = greedy(backend, 6)
        assert count["prefills"] == 1
        assert steered == manual(backend.model, prompt, block, v, alpha, 6, backend.stop_set)
        changed |= steered != plain
    assert changed  # the vector is strong enough to matter, so the equality above says something
    assert backend.prefix_cache is cache_before and len(backend.prefix_cache) == entries  # nothing steered kept
    assert greedy(backend, 6) == plain  # and the hook is gone
    asyncio.run(backend.aclose())
