"""The hf backend's own decode loop runs on both spellings of the cache argument (issue 30, item 4):
`cache=` (transformers 5.24, lhd's pin) and `past_key_values=` (5.17, the lent GPU image's; before,
such a model silently decoded with `model.generate`, whose one-shot padded prefill the memory budget
does not count). Which path ran is recorded: `describe()["decode_path"]` (in every run's manifest)
and per-path batch counts in `stats`. `make test-compat` runs this file on transformers 5.17 itself.

The `past_key_values` spelling here is transformers' own Llama under the older signature: a subclass
whose forward takes the cache as `past_key_values` and hands it to the library's forward."""
from __future__ import annotations

import asyncio
import inspect

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from rollouts.hf import HFBackend
from rollouts.hf.spec import HFSpec
from rollouts.tokenizer import load_tokenizer
from rollouts.types import GenerationRequest, SamplingParams

SPELLING = "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"
OTHER = "past_key_values" if SPELLING == "cache" else "cache"


def _other_spelling_class() -> type:
    """transformers' Llama, its cache argument renamed to the spelling this transformers does not use."""

    class Renamed(LlamaForCausalLM):
        def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, labels=None,
                    use_cache=None, logits_to_keep=0, **kwargs):
            if OTHER in kwargs:
                kwargs[SPELLING] = kwargs.pop(OTHER)
            return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                   inputs_embeds=inputs_embeds, labels=labels, use_cache=use_cache,
                                   logits_to_keep=logits_to_keep, **kwargs)

    params = [p for p in inspect.signature(Renamed.forward).parameters.values() if p.kind != p.VAR_KEYWORD]
    params.insert(4, inspect.Parameter(OTHER, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None))
    params.append(inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD))
    Renamed.forward.__signature__ = inspect.Signature(params)
    return Renamed


def _backend(model, path) -> HFBackend:
    spec = HFSpec(model=str(path), batch_wait_ms=30, max_batch_size=8)
    return HFBackend(spec, model.eval(), load_tokenizer(str(path)), "cpu", torch.float32)


def _greedy(backend: HFBackend, prompts: list[str], max_tokens: int = 16) -> list[list[int]]:
    reqs = [GenerationRequest([{"role": "user", "content": p}], SamplingParams(temperature=0.0, max_tokens=max_tokens))
            for p in prompts]

    async def go():
        try:
            return await asyncio.gather(*(backend.generate([r]) for r in reqs))
        finally:
            await backend.aclose()

    return [res.completions[0].token_ids for (res,) in asyncio.run(go())]


@pytest.mark.parametrize("spelling", ["installed", "other"])
def test_the_own_loop_runs_on_both_cache_spellings(tiny_llama_dir, spelling):
    cls = LlamaForCausalLM if spelling == "installed" else _other_spelling_class()
    model = cls.from_pretrained(str(tiny_llama_dir), dtype=torch.float32)
    backend = _backend(model, tiny_llama_dir)
    arg = SPELLING if spelling == "installed" else OTHER
    assert backend.describe()["decode_path"] == f"loop ({arg}=)"
    prompts = ["What is 2 + 2?", "Name a colour. " * 12, "Status?"]
    got = _greedy(backend, prompts)
    assert backend.stats["loop_batches"] >= 1 and backend.stats["generate_batches"] == 0
    # the same tokens as transformers' own greedy generate, one prompt at a time
    plain = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    tok = backend.tokenizer
    for prompt, ids_out in zip(prompts, got, strict=True):
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      return_dict=False)
        with torch.inference_mode():
            out = plain.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 do_sample=False, max_new_tokens=16)
        expected = out[0, len(ids):].tolist()
        stops = [t for t in expected if t in backend.stop_set]
        if stops:
            expected = expected[: expected.index(stops[0])]
        assert ids_out == expected


def test_a_model_without_either_spelling_decodes_with_generate_and_says_so(tiny_llama_dir):
    """A forward that takes neither (remote code of another signature) falls back, recorded as such."""

    class NoCache(LlamaForCausalLM):
        def forward(self, input_ids=None, attention_mask=None, position_ids=None, logits_to_keep=0, **kwargs):
            return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                   logits_to_keep=logits_to_keep, **kwargs)

    backend = _backend(NoCache.from_pretrained(str(tiny_llama_dir), dtype=torch.float32), tiny_llama_dir)
    assert backend.describe()["decode_path"] == "model.generate"
    _greedy(backend, ["Status?"], 4)
    assert backend.stats["generate_batches"] == 1 and backend.stats["loop_batches"] == 0
