"""benchmarks/rollout_throughput.py measures every mode on the same work: the same requests (by
construction, from one recorded pass), the same prompt tokens, exactly `max_tokens` generated per
request, and it reports rates against a peak it measured."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _load_benchmark():
    spec = importlib.util.spec_from_file_location("rollout_throughput", ROOT / "benchmarks" / "rollout_throughput.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("batch_dependent", [False, True])
def test_every_mode_sends_the_same_requests(tmp_path, tiny_llama_dir, monkeypatch, batch_dependent):
    """With `batch_dependent`, a row's sampling depends on its batch's size (injected: what makes vLLM's
    answers differ between one request at a time and many), so the answers, and the prompts built on
    them, differ between the sequential and the engine mode unless the benchmark fixes them."""
    if batch_dependent:
        from rollouts.hf.sampling import RowSampler

        plain = RowSampler.__init__

        def init(self, backend, rows, *a, **k):
            plain(self, backend, rows, *a, **k)
            for r in rows:
                r.generator = torch.Generator().manual_seed(r.seed + 7919 * len(rows))

        monkeypatch.setattr(RowSampler, "__init__", init)
    bench = _load_benchmark()
    out = bench.bench_backend("hf", tiny_llama_dir, trials=2, tasks=1, vllm=None, tmp=tmp_path, peak_seconds=0.2)
    modes = out["modes"]
    assert list(modes) == ["sequential", "engine", "replay", "flat"]
    seq = modes["sequential"]
    assert seq["requests"] >= 2 * 2  # at least a performer and a supervisor request per trial
    for name, m in modes.items():
        assert m["errors"] == 0, (name, m)
        # one set of requests (same messages, sampling, count) and the same token counts everywhere
        assert (m["requests"], m["requests_sha256"], m["prompt"], m["completion"]) == \
            (seq["requests"], seq["requests_sha256"], seq["prompt"], seq["completion"]), (name, modes)
        # fixed output length: every request generated exactly the max_tokens it asked for
        assert m["completion"] == m["asked"], (name, m)
        assert m["prompt_tok_s"] > 0 and m["gen_tok_s"] > 0 and 0 < m["peak_fraction"] < 1, (name, m)
    assert out["peak_flops"] > 0 and out["params"] > 0
    text = bench.report([out], "test")
    assert "same requests and token counts in every mode: yes" in text
    assert "of peak" in text and "gen/s" in text


def _fixed_length_body() -> tuple[dict, dict]:
    """The OpenAI backend's body for a schema request, as sent plainly and in the benchmark's form."""
    from rollouts.backends import build_backend
    from rollouts.openai_backend import OpenAISpec
    from rollouts.types import GenerationRequest, SamplingParams

    bench = _load_benchmark()
    backend = build_backend(OpenAISpec(model="m", base_url="http://127.0.0.1:9/v1",
                                                tokenizer=None))
    req = GenerationRequest([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=7, seed=3),
                            {"type": "object"})
    with bench.ignore_eos(backend):
        fixed = backend._payload(bench.fixed_length(req), "vllm")
    return backend._payload(req, "vllm"), fixed


def test_openai_backend_asks_vllm_for_exactly_max_tokens():
    plain, fixed = _fixed_length_body()
    assert fixed["extra_body"] == {"ignore_eos": True, "min_tokens": 7} and fixed["max_tokens"] == 7
    assert plain["extra_body"] == {"structured_outputs": {"json": {"type": "object"}}}  # restored after


@pytest.mark.vllm
def test_vllm_accepts_the_fixed_length_request(vllm_python):
    """vLLM 0.32's own request model (the session's vLLM interpreter) turns the body into sampling
    params of exactly max_tokens."""
    import json

    _, fixed = _fixed_length_body()
    body = {**{k: v for k, v in fixed.items() if k != "extra_body"}, **fixed["extra_body"]}
    code = ("import json, sys\n"
            "from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest\n"
            "r = ChatCompletionRequest.model_validate(json.loads(sys.argv[1]))\n"
            "print(json.dumps({'ignore_eos': r.ignore_eos, 'min_tokens': r.min_tokens, 'max_tokens': r.max_tokens}))")
    out = vllm_python.run([vllm_python.python, "-c", code, json.dumps(body)])
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"ignore_eos": True, "min_tokens": 7, "max_tokens": 7}
