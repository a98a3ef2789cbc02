"""Cross-request prefix cache: the store itself, and the `hf` backend reusing keys/values across the
turns of a conversation without changing a single generated token."""
from __future__ import annotations

import asyncio

import pytest
import torch

from rollouts.hf import HFBackend
from rollouts.hf.prefix_cache import PrefixCache, common_prefix
from rollouts.hf.spec import HFSpec
from rollouts.types import GenerationRequest, SamplingParams


def kv(ids, layers=2, tag=0.0):
    """Fake per-layer keys/values whose column i encodes token ids[i], so a slice shows which
    tokens it came from."""
    col = torch.tensor(ids, dtype=torch.float32) + tag
    t = col.view(1, 1, -1, 1).expand(1, 2, -1, 3).clone()
    return [(t.clone(), -t.clone()) for _ in range(layers)]


PER_TOKEN = 2 * 2 * 2 * 3 * 4  # bytes of `kv` per token: layers x (keys, values) x heads x dim x fp32


def test_common_prefix():
    import numpy as np

    a = np.array([1, 2, 3, 4])
    assert common_prefix(a, np.array([1, 2, 9])) == 2
    assert common_prefix(a, np.array([1, 2, 3, 4, 5])) == 4
    assert common_prefix(a, np.array([7])) == 0


def test_lookup_returns_longest_match_sliced_and_capped():
    cache = PrefixCache(max_bytes=1000 * PER_TOKEN, min_match=2)
    cache.insert(None, list(range(10)), kv(range(10)))
    cache.insert(None, [0, 1, 2, 50, 51], kv([0, 1, 2, 50, 51]))
    n, layers = cache.lookup(None, list(range(8)) + [99], limit=8)
    assert n == 8
    k, v = layers[0]
    assert k.shape == (1, 2, 8, 3) and k[0, 0, :, 0].tolist() == list(range(8)) and torch.equal(v, -k)
    n, layers = cache.lookup(None, [0, 1, 2, 50, 7], limit=100)
    assert n == 4 and layers[1][0][0, 0, :, 0].tolist() == [0, 1, 2, 50]
    # the cap: a prompt fully in the cache still leaves its last token to compute
    n, _ = cache.lookup(None, list(range(10)), limit=9)
    assert n == 9
    assert cache.lookup(None, [5, 6, 7], limit=3) == (0, None)
    assert cache.stats["hits"] == 3 and cache.stats["hit_tokens"] == 21


def test_adapters_never_share_entries():
    cache = PrefixCache(max_bytes=1000 * PER_TOKEN, min_match=2)
    cache.insert("honest", list(range(10)), kv(range(10)))
    assert cache.lookup(None, list(range(10)), limit=9) == (0, None)
    assert cache.lookup("other", list(range(10)), limit=9) == (0, None)
    assert cache.lookup("honest", list(range(10)), limit=9)[0] == 9


def test_prefix_entries_are_superseded_and_lru_evicts_to_budget():
    cache = PrefixCache(max_bytes=30 * PER_TOKEN, min_match=2)
    cache.insert(None, list(range(10)), kv(range(10)))
    cache.insert(None, list(range(15)), kv(range(15)))  # extends the first: replaces it
    assert len(cache) == 1 and cache.tokens == 15 and cache.nbytes == 15 * PER_TOKEN
    cache.insert(None, list(range(12)), kv(range(12)))  # already covered: nothing new
    assert len(cache) == 1 and cache.tokens == 15
    cache.insert(None, [100 + i for i in range(10)], kv([100 + i for i in range(10)]))
    assert cache.tokens == 25
    cache.lookup(None, list(range(5)), limit=5)  # touch the first entry: the second is now oldest
    cache.insert(None, [200 + i for i in range(10)], kv([200 + i for i in range(10)]))
    assert cache.tokens == 25 and cache.stats["evictions"] == 1
    assert cache.lookup(None, [100 + i for i in range(10)], limit=9) == (0, None)
    assert cache.lookup(None, list(range(15)), limit=14)[0] == 14
    # too long for the budget, or disabled: not stored
    cache.insert(None, list(range(300, 340)), kv(range(300, 340)))
    assert cache.lookup(None, list(range(300, 340)), limit=39) == (0, None)
    off = PrefixCache(max_bytes=0)
    off.insert(None, list(range(50)), kv(range(50)))
    assert len(off) == 0
    with pytest.raises(ValueError, match="max_bytes"):
        PrefixCache(max_bytes=-1)


# ---------------------------------------------------------------- in the hf backend
def backend_for(path, **kw) -> HFBackend:
    return HFBackend.from_spec(HFSpec(model=str(path), batch_wait_ms=0, **kw))


def ask(backend, messages, max_tokens=24, temperature=0.0, seed=None):
    req = GenerationRequest(messages, SamplingParams(temperature=temperature, top_p=0.9,
                                                     max_tokens=max_tokens, seed=seed))
    return asyncio.run(backend.generate([req]))[0]


def conversation(backend, turns, **kw):
    """A multi-turn chat as the performer holds it: each prompt is the previous one plus the answer
    and a new user message. Returns every turn's result."""
    msgs = [{"role": "system", "content": "You are a careful analyst. " * 20}]
    results = []
    for text in turns:
        msgs.append({"role": "user", "content": text})
        res = ask(backend, msgs, **kw)
        assert res.ok, res.error
        results.append(res)
        msgs.append({"role": "assistant", "content": res.text})
    return results


TURNS = ["Summarise the dock schedule for berth two. " * 6, "Now list the risks.", "Any delays expected? " * 4]


@pytest.mark.parametrize("which", ["tiny_llama_dir", "tiny_qwen3_dir"])
def test_conversation_reuses_earlier_turns_without_changing_tokens(which, request):
    path = request.getfixturevalue(which)
    cached = backend_for(path)
    plain = backend_for(path, enable_prefix_caching=False)
    for kw in ({"temperature": 0.0}, {"temperature": 1.0, "seed": 7}):
        with_cache = conversation(cached, TURNS, **kw)
        without = conversation(plain, TURNS, **kw)
        assert [r.completions[0].token_ids for r in with_cache] == [r.completions[0].token_ids for r in without]
        assert all(r.cached_tokens == 0 for r in without)
        # every later turn found the earlier conversation in the cache (all but the last tokens of
        # the previous prompt at least: the template may tokenise the answer's start differently)
        for prev, res in zip(with_cache, with_cache[1:], strict=False):
            assert res.cached_tokens >= prev.prompt_tokens - 4, (prev.prompt_tokens, res.cached_tokens)
            assert res.cached_tokens < res.prompt_tokens
    assert plain.stats["prefix_reused_tokens"] == 0
    assert cached.stats["prefix_reused_tokens"] > 0
    assert cached.stats["prefill_tokens"] + cached.stats["prefix_reused_tokens"] == plain.stats["prefill_tokens"]


def test_reused_keys_values_equal_a_fresh_prefill(tiny_llama_dir):
    """The cache's entry for prompt + answer (its answer part written by the batched decode) holds
    the keys/values a single full prefill of the same tokens computes."""
    from transformers import DynamicCache

    backend = backend_for(tiny_llama_dir)
    msgs = [{"role": "user", "content": "Describe the berth plan in detail. " * 10}]
    res = ask(backend, msgs, max_tokens=20, temperature=1.0, seed=3)
    ids = res.prompt_token_ids + res.completions[0].token_ids
    n, layers = backend.prefix_cache.lookup(None, ids + [0], limit=len(ids))
    fed = len(res.completions[0].token_ids) - (res.completions[0].finish_reason == "length")
    assert n == len(res.prompt_token_ids) + fed
    fresh = DynamicCache()
    with torch.inference_mode():
        backend.model(input_ids=torch.tensor([ids[:n]]), cache=fresh, use_cache=True)
    for (k, v), layer in zip(layers, fresh.layers, strict=False):
        assert torch.allclose(k, layer.keys, atol=1e-4) and torch.allclose(v, layer.values, atol=1e-4)


def test_lora_adapter_rows_do_not_reuse_base_model_entries(tiny_llama_dir, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    peft = get_peft_model(model, LoraConfig(r=4, target_modules=["k_proj", "v_proj"], init_lora_weights=False))
    peft.save_pretrained(tmp_path / "adapter")
    backend = backend_for(tiny_llama_dir, adapters={"a": str(tmp_path / "adapter")})
    msgs = [{"role": "user", "content": "Same words, other weights. " * 8}]
    ask(backend, msgs)
    other = ask(backend, msgs + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}])
    req = GenerationRequest(msgs + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}],
                            SamplingParams(temperature=0.0, max_tokens=24), adapter="a")
    with_adapter = asyncio.run(backend.generate([req]))[0]
    assert other.cached_tokens > 0 and with_adapter.cached_tokens == 0
    fresh = backend_for(tiny_llama_dir, adapters={"a": str(tmp_path / "adapter")}, enable_prefix_caching=False)
    alone = asyncio.run(fresh.generate([req]))[0]
    assert with_adapter.completions[0].token_ids == alone.completions[0].token_ids
