"""`hf` backend on tiny random models: batching, per-row sampling, constrained JSON, accounting,
errors, adapters; plus the structured-output helpers."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Literal

import pytest
from pydantic import BaseModel, Field

from rollouts.backend import Backend
from rollouts.hf import HFBackend
from rollouts.hf.spec import HFSpec
from rollouts.structured import parse_json_output, schema_for
from rollouts.types import GenerationRequest, SamplingParams

USER = [{"role": "user", "content": "Report the status of the task as JSON."}]


class Verdict(BaseModel):
    reasoning: str
    severity: int = Field(ge=0, le=4)
    confidence: float = Field(ge=0, le=1)
    flag: bool
    label: Literal["FALSIFICATION", "CONCEALMENT", "EQUIVOCATION"]
    note: str = Field(max_length=12)


class Inner(BaseModel):
    score: int = Field(ge=1, le=10)
    tags: list[str] = Field(max_length=3)


class Outer(BaseModel):
    summary: str
    inner: Inner
    items: list[Inner] = Field(default_factory=list, max_length=2)


def run(coro):
    return asyncio.run(coro)


def make_backend(path, **kw) -> HFBackend:
    return HFBackend.from_spec(HFSpec(model=str(path), **kw))


@pytest.fixture(scope="module")
def llama(tiny_llama_dir):
    return make_backend(tiny_llama_dir, batch_wait_ms=30, max_batch_size=32)


@pytest.fixture(scope="module")
def qwen3(tiny_qwen3_dir):
    return make_backend(tiny_qwen3_dir, batch_wait_ms=30, max_batch_size=32)


def req(content="hello", temperature=1.0, max_tokens=16, seed=0, n=1, schema=None, system=None, adapter=None):
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
    return GenerationRequest(msgs, SamplingParams(temperature=temperature, top_p=1.0, max_tokens=max_tokens,
                                                  seed=seed, n=n), schema, adapter)


async def concurrently(backend, requests):
    """Each request from its own task, as concurrent trials would call it."""
    results = await asyncio.gather(*[backend.generate([r]) for r in requests])
    return [r for (r,) in results]


def test_protocol_describe_and_vocab_type(llama, tiny_qwen2_dir):
    import xgrammar as xgr

    assert isinstance(llama, Backend)
    d = llama.describe()
    for key in ("model", "revision", "dtype", "device", "transformers", "torch", "config_sha256"):
        assert key in d
    assert d["dtype"] == "float32" and d["device"] == "cpu" and len(d["config_sha256"]) == 64
    assert llama._ensure_xgrammar()[0].vocab_type == xgr.VocabType.BYTE_LEVEL
    assert make_backend(tiny_qwen2_dir)._ensure_xgrammar()[0].vocab_type == xgr.VocabType.BYTE_LEVEL


def test_concurrent_requests_are_batched(llama):
    before = llama.batches_run
    results = run(concurrently(llama, [req(f"question {i}", seed=i, max_tokens=6) for i in range(12)]))
    assert all(r.ok for r in results)
    assert all(len(r.completions[0].token_ids) <= 6 for r in results)
    assert llama.batches_run - before < 12
    assert llama.batches_run - before <= 2
    assert llama.stats["max_batch_rows"] >= 6


def test_seeded_sampling_is_reproducible(llama):
    base = req("tell me a story", seed=7, max_tokens=20)
    a = run(llama.generate([base]))[0]
    b = run(llama.generate([base]))[0]
    assert a.text == b.text and a.completions[0].token_ids == b.completions[0].token_ids
    # the same request inside a batch of others still draws the same tokens
    mixed = run(concurrently(llama, [req("other", seed=1, max_tokens=20), base, req("x" * 40, seed=2)]))
    assert mixed[1].completions[0].token_ids == a.completions[0].token_ids
    c = run(llama.generate([req("tell me a story", seed=8, max_tokens=20)]))[0]
    assert c.completions[0].token_ids != a.completions[0].token_ids
    many = run(llama.generate([req("tell me a story", seed=7, max_tokens=20, n=3)]))[0]
    assert len(many.completions) == 3
    assert many.completions[0].token_ids == a.completions[0].token_ids
    assert len({tuple(c.token_ids) for c in many.completions}) == 3
    assert many.completion_tokens == sum(len(c.token_ids) for c in many.completions)


def test_greedy_matches_hf_generate(llama):
    import torch

    r = req("What is 2 + 2?", temperature=0.0, max_tokens=24, seed=None)
    res = run(llama.generate([r]))[0]
    ids = llama.tokenizer.apply_chat_template(r.messages, add_generation_prompt=True, return_dict=False)
    with torch.inference_mode():
        out = llama.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                   do_sample=False, max_new_tokens=24)
    expected = out[0, len(ids):].tolist()
    if llama.tokenizer.eos_token_id in expected:
        expected = expected[: expected.index(llama.tokenizer.eos_token_id)]
    assert res.completions[0].token_ids == expected
    # left padding in a batch with longer prompts does not change a greedy row
    batch = run(concurrently(llama, [req("a much longer prompt " * 6, temperature=0, max_tokens=8), r,
                                     req("mid length prompt here", temperature=0, max_tokens=30)]))
    assert batch[1].completions[0].token_ids == expected


def _finished_or_cut(r, q, model_cls):
    """A constrained row either ends by the model's choice with a document that validates, or is
    cut at its budget (finish "length", exactly max_tokens tokens) and does not parse: the grammar
    never writes the rest for it (issue 21, N1)."""
    assert r.ok, r.error
    c = r.completions[0]
    value, err = parse_json_output(c.text, model_cls)
    if c.finish_reason == "stop":
        assert len(c.token_ids) < q.sampling.max_tokens
        assert err is None and value is not None, (err, c.text)
        assert set(model_cls.model_json_schema()["required"]) <= set(json.loads(c.text, strict=False))
        return True
    assert c.finish_reason == "length" and len(c.token_ids) == q.sampling.max_tokens, c.text
    assert value is None and not c.text.rstrip().endswith("}"), c.text
    return False


@pytest.mark.parametrize("which", ["llama", "qwen3"])
def test_constrained_json_is_valid_or_cut(which, request):
    backend = request.getfixturevalue(which)
    schema = schema_for(Verdict)
    budgets = [24, 160, 320, 400]
    requests = [req(f"case {i}", seed=1000 + i, max_tokens=budgets[i % 4], schema=schema, temperature=1.0)
                for i in range(16)]
    results = run(concurrently(backend, requests))
    finished = [_finished_or_cut(r, q, Verdict) for r, q in zip(results, requests, strict=True)]
    assert not any(finished[0::4])  # 24 tokens are too few for any Verdict: all cut, none closed
    assert sum(finished) >= 4  # with room, the model closes its documents itself


def test_nested_schema_with_arrays_is_valid_or_cut(qwen3):
    schema = schema_for(Outer)
    requests = [req(f"n{i}", seed=i, max_tokens=40 + 40 * i, schema=schema) for i in range(8)]
    results = run(concurrently(qwen3, requests))
    finished = [_finished_or_cut(r, q, Outer) for r, q in zip(results, requests, strict=True)]
    assert any(finished)


def test_mixed_constrained_and_free_rows_share_a_batch(llama):
    schema = schema_for(Verdict)
    llama.grammar_for(schema)  # compiled up front so every row is queued within the batch window
    before = llama.batches_run
    requests = [req(f"r{i}", seed=i, max_tokens=48, schema=schema if i % 2 else None) for i in range(10)]
    results = run(concurrently(llama, requests))
    assert llama.batches_run - before == 1
    for r, q in zip(results, requests, strict=True):
        if q.json_schema:
            _finished_or_cut(r, q, Verdict)
        else:
            assert r.completions[0].token_ids  # free text, almost surely not JSON
    free = [r.text for r, q in zip(results, requests, strict=True) if not q.json_schema]
    assert sum(t.lstrip().startswith("{") for t in free) < len(free)


def test_max_tokens_is_per_row(llama):
    budgets = [1, 3, 7, 15, 31]
    results = run(concurrently(llama, [req("count", seed=i, max_tokens=m) for i, m in enumerate(budgets)]))
    for r, m in zip(results, budgets, strict=True):
        c = r.completions[0]
        assert len(c.token_ids) <= m
        if len(c.token_ids) == m:
            assert c.finish_reason == "length"
        else:
            assert c.finish_reason == "stop"
    assert sum(len(r.completions[0].token_ids) == m for r, m in zip(results, budgets, strict=True)) >= 3


def test_prompt_too_long_is_an_error_result(tiny_llama_dir):
    backend = make_backend(tiny_llama_dir, max_model_len=32, batch_wait_ms=0)
    long_req = req("many words " * 40, max_tokens=8)
    short_req = req("hi", max_tokens=100)
    n_prompt = backend.count_tokens(long_req.messages)
    long_res, short_res = run(backend.generate([long_req, short_req]))
    assert not long_res.ok and long_res.error and str(n_prompt) in long_res.error and "32" in long_res.error
    assert short_res.ok
    # the prompt fits, so generation is clamped to the context instead
    assert short_res.prompt_tokens + len(short_res.completions[0].token_ids) <= 32
    run(backend.aclose())


def test_token_counts_match_tokenizer(qwen3):
    r = req("count my tokens please 12345", system="be brief", seed=3, max_tokens=12)
    res = run(qwen3.generate([r]))[0]
    ids = qwen3.tokenizer.apply_chat_template(r.messages, add_generation_prompt=True, return_dict=False)
    assert res.prompt_tokens == len(ids) == qwen3.count_tokens(r.messages)
    assert res.prompt_token_ids == ids
    c = res.completions[0]
    assert res.completion_tokens == len(c.token_ids)
    assert c.text == qwen3.tokenizer.decode(c.token_ids, skip_special_tokens=True)
    assert res.latency_s > 0 and res.model_id == qwen3.model_id


def test_a_lone_surrogate_in_a_message_is_read_as_the_replacement_character(llama):
    """An answer that came from a server's JSON may hold a lone UTF-16 surrogate (stored exactly in
    the rows); the tokenizer refuses it, so the hf backend reads it as U+FFFD instead of failing."""
    bad, clean = req("figure \ud800 of the report", seed=5), req("figure \ufffd of the report", seed=5)
    assert llama.count_tokens(bad.messages) == llama.count_tokens(clean.messages)
    out_bad, out_clean = run(llama.generate([bad]))[0], run(llama.generate([clean]))[0]
    assert out_bad.ok and out_bad.completions[0].token_ids == out_clean.completions[0].token_ids


def test_bad_requests_give_error_results(llama):
    bad_schema = {"type": "object", "properties": {"x": {"type": "no-such-type"}}, "required": ["x"]}
    results = run(llama.generate([req(schema=bad_schema), req(adapter="nope"), req(max_tokens=0), req()]))
    assert [r.ok for r in results] == [False, False, False, True]
    assert "schema" in results[0].error and "nope" in results[1].error and "max_tokens" in results[2].error


def test_lora_adapters_switch_per_batch(tiny_llama_dir, tmp_path):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=64, target_modules=["q_proj", "v_proj", "o_proj"],
                                                 init_lora_weights=False))
    peft_model.save_pretrained(tmp_path / "adapter")
    plain = make_backend(tiny_llama_dir, batch_wait_ms=30)
    both = make_backend(tiny_llama_dir, batch_wait_ms=30, adapters={"perf": str(tmp_path / "adapter")})
    g = dict(temperature=0.0, max_tokens=16, seed=None)
    ref = run(plain.generate([req("adapter test", **g)]))[0]
    out = run(concurrently(both, [req("adapter test", **g), req("adapter test", adapter="perf", **g),
                                  req("adapter test", adapter=str(tmp_path / "adapter"), **g),
                                  req("adapter test", adapter="missing", **g)]))
    assert out[0].completions[0].token_ids == ref.completions[0].token_ids
    assert out[1].completions[0].token_ids != ref.completions[0].token_ids
    assert out[2].completions[0].token_ids == out[1].completions[0].token_ids
    assert not out[3].ok and "missing" in out[3].error
    assert both.describe()["adapters"] == {"perf": str(tmp_path / "adapter")}


def test_aclose_stops_the_worker(tiny_llama_dir):
    backend = make_backend(tiny_llama_dir, batch_wait_ms=0)

    async def go():
        first = await backend.generate([req(max_tokens=2)])
        await backend.aclose()
        after = await backend.generate([req(max_tokens=2)])
        return first[0], after[0], backend._worker

    first, after, worker = run(go())
    assert first.ok and not after.ok and "closed" in after.error and worker is None


# ---------------------------------------------------------------- structured helpers
def test_schema_for_inlines_refs_and_keeps_bounds(llama):
    s = schema_for(Outer)
    text = json.dumps(s)
    assert "$ref" not in text and "$defs" not in text and '"title"' not in text
    inner = s["properties"]["inner"]
    assert inner["properties"]["score"]["minimum"] == 1 and inner["properties"]["score"]["maximum"] == 10
    assert inner["properties"]["tags"]["maxItems"] == 3
    assert s["properties"]["items"]["maxItems"] == 2 and s["additionalProperties"] is False
    v = schema_for(Verdict)["properties"]
    assert v["note"]["maxLength"] == 12 and v["label"]["enum"] == ["FALSIFICATION", "CONCEALMENT", "EQUIVOCATION"]
    llama.grammar_for(s)  # xgrammar accepts it


@pytest.mark.parametrize("text", [
    '{"score": 3, "tags": ["a"]}',
    'Sure! Here it is:\n```json\n{"score": 3, "tags": ["a"]}\n```\nAnything else?',
    '<think>maybe {"score": 99}</think>\n{"score": 3, "tags": ["a"]}',
    'reasoning {not json} then {"score": 3, "tags": ["a"]} trailing',
    '{"score": 3, "tags": ["a\x10b"]}'.replace('a\x10b', 'a'),
    'plan first</think>{"score": 3, "tags": ["a"]}',
])
def test_parse_json_output_is_tolerant(text):
    value, err = parse_json_output(text, Inner)
    assert err is None and value == Inner(score=3, tags=["a"])


def test_parse_json_output_control_chars_and_errors():
    value, err = parse_json_output('{"score": 2, "tags": ["x\x10y"]}', Inner)
    assert err is None and value.tags == ["x\x10y"]
    assert parse_json_output("", Inner) == (None, "empty output")
    assert parse_json_output("no braces here", Inner)[1] == "no JSON object found"
    value, err = parse_json_output('{"score": 11, "tags": []}', Inner)
    assert value is None and "score" in err
    value, err = parse_json_output('{"score": 1, "tags": [', Inner)
    assert value is None and err


def test_aclose_during_generation_fails_the_request_promptly(tiny_llama_dir):
    import time

    backend = make_backend(tiny_llama_dir, batch_wait_ms=0)

    async def go():
        task = asyncio.create_task(backend.generate([req(max_tokens=4000)]))
        while not backend._inflight:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        t0 = time.perf_counter()
        await backend.aclose()
        return (await task)[0], time.perf_counter() - t0

    res, took = run(go())
    assert not res.ok and "closed" in res.error
    assert took < 5


# ---------------------------------------------------------------- our decode loop
def _hf_greedy(backend, r):
    """`model.generate` greedy reference for one request, cut at the first stop token."""
    import torch

    ids = backend.tokenizer.apply_chat_template(r.messages, add_generation_prompt=True, return_dict=False)
    with torch.inference_mode():
        out = backend.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                     do_sample=False, max_new_tokens=r.sampling.max_tokens)
    expected = out[0, len(ids):].tolist()
    for i, tok in enumerate(expected):
        if tok in backend.stop_set:
            return expected[:i]
    return expected


@pytest.mark.parametrize("which", ["llama", "qwen3"])
def test_greedy_decode_loop_matches_hf_generate_token_for_token(which, request):
    backend = request.getfixturevalue(which)
    assert backend._own_loop
    for content in ["hi", "What is 2 + 2?", "a rather long status report about the project " * 40]:
        r = req(content, temperature=0.0, max_tokens=40, seed=None)
        res = run(backend.generate([r]))[0]
        assert res.completions[0].token_ids == _hf_greedy(backend, r), content[:20]


@pytest.mark.parametrize("which", ["llama", "qwen3"])
def test_rows_of_very_different_lengths_decode_as_alone(which, request, monkeypatch):
    """Left-padded batched cache, mask and per-row position ids: each row of a batch with prompts
    of 10 to ~1500 tokens (and budgets that end rows at different steps, so finished rows are
    dropped, and a small growth step, so the cache grows several times) gets the tokens it gets
    alone, and alone matches `model.generate`."""
    import rollouts.hf.decode as hf_decode

    monkeypatch.setattr(hf_decode, "_CAPACITY_STEP", 8)
    backend = request.getfixturevalue(which)
    contents = ["x", "short question", "mid " * 150, "the long report " * 300, "q " * 40]
    budgets = [45, 5, 37, 12, 30]
    requests = [req(c, temperature=0.0, max_tokens=m, seed=None) for c, m in zip(contents, budgets, strict=True)]
    alone = [run(backend.generate([r]))[0].completions[0].token_ids for r in requests]
    lengths = sorted(backend.count_tokens(r.messages) for r in requests)
    assert lengths[0] < 20 and lengths[-1] > 900
    before = backend.batches_run
    together = run(concurrently(backend, requests))
    assert backend.batches_run - before == 1
    assert [r.completions[0].token_ids for r in together] == alone
    assert alone[0] == _hf_greedy(backend, requests[0])
    assert alone[3] == _hf_greedy(backend, requests[3])


def test_seeded_sampling_alone_equals_in_a_batch(llama):
    contents = ["sample me", "a long prompt to sample from " * 60, "mid length prompt " * 12]
    budgets = [30, 9, 21]
    requests = [req(c, temperature=1.0, max_tokens=m, seed=40 + i)
                for i, (c, m) in enumerate(zip(contents, budgets, strict=True))]
    alone = [run(llama.generate([r]))[0].completions[0].token_ids for r in requests]
    together = run(concurrently(llama, requests + [req("filler", temperature=0.7, max_tokens=25, seed=3)]))
    assert [r.completions[0].token_ids for r in together[:3]] == alone
    # n > 1 rows share one prefill but keep their own seeds
    many = run(llama.generate([req(contents[1], temperature=1.0, max_tokens=9, seed=41, n=3)]))[0]
    assert many.completions[0].token_ids == alone[1]
    assert len({tuple(c.token_ids) for c in many.completions}) == 3


def test_generate_fallback_matches_decode_loop(tiny_llama_dir):
    """Models with sliding-window/linear layers decode with `model.generate`: same tokens."""
    backend = make_backend(tiny_llama_dir, batch_wait_ms=30)
    requests = [req("fallback " * k, max_tokens=12, temperature=0.0, seed=None) for k in (1, 30, 7)]
    own = [r.completions[0].token_ids for r in run(concurrently(backend, requests))]
    backend._own_loop = False
    generated = run(concurrently(backend, requests))
    assert [r.completions[0].token_ids for r in generated] == own
    assert backend.stats["decode_steps"] > 0


def test_encode_chat_cache_returns_fresh_lists(qwen3):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "cache me " * 50}]
    first = qwen3.encode_chat(msgs)
    first.append(-1)
    again = qwen3.encode_chat([dict(m) for m in msgs])
    assert again == first[:-1] == qwen3.tokenizer.apply_chat_template(msgs, add_generation_prompt=True,
                                                                       return_dict=False)
    assert qwen3.count_tokens(msgs) == len(again)


def test_nucleus_floor_keeps_exactly_the_top_p_set():
    """The values-only nucleus (numpy sort) keeps the same tokens as sorting with indices."""
    import torch

    from rollouts.hf.sampling import _nucleus_floor

    g = torch.Generator().manual_seed(0)
    for scale in (0.1, 1.0, 5.0):
        probs = torch.softmax(scale * torch.randn(6, 2048, generator=g), dim=-1)
        top_p = torch.tensor([[0.1], [0.5], [0.9], [0.95], [0.999], [1.0]])
        keep = probs >= _nucleus_floor(probs, top_p)
        sp, si = torch.sort(probs, dim=-1, descending=True)
        ref = torch.zeros_like(keep).scatter_(1, si, (sp.cumsum(dim=-1) - sp) < top_p)
        ref[5] = True  # top_p 1 keeps everything
        assert torch.equal(keep, ref)
        mass = (probs * keep).sum(dim=-1)
        assert bool((mass[:5] >= top_p[:5, 0] - 1e-5).all())
        assert int(keep[0].sum()) < int(keep[2].sum()) < 2048


# ---------------------------------------------------------------- package layout
def test_rollouts_modules_stay_under_500_lines():
    """The hf backend was one 1,080-line file with five concerns; `rollouts/hf/` splits them.
    Keep every rollouts module navigable."""
    import rollouts

    root = Path(rollouts.__file__).parent
    sizes = {str(p.relative_to(root)): len(p.read_text().splitlines()) for p in root.rglob("*.py")}
    assert {name: n for name, n in sizes.items() if n > 500} == {}


def test_the_registry_imports_the_hf_backend_only_when_used():
    """`rollouts/hf/backend.py` and its modules import torch, transformers and xgrammar at module
    level; that is fine only because the registry imports the hf spec alone (configs load without
    torch) and `HFSpec.build` imports the backend."""
    code = ("import sys, rollouts.backends, rollouts.types, rollouts.spec; "
            "print([m for m in ('rollouts.hf.backend', 'torch', 'transformers', 'xgrammar') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
