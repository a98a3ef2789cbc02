"""Issue 21 items 1 and 4: no value is invented at the token limit, and each role decodes with the
model's own generation defaults unless the config sets them.

Item 1: the `hf` backend returns a structured answer cut at its budget as cut (finish_reason
"length", the cut text), as vLLM and any OpenAI-compatible server do; `ask_structured` never
parses a cut answer, retries it with twice the budget, and ends `cut` with every call recorded, on
all three paths for the same cut output. The OpenAI and vLLM paths talk to a real HTTP server on
127.0.0.1 (standard library) that answers with that cut output; vLLM's own request classes are
checked in `test_vllm_applies_the_model_defaults_to_what_we_send` (.venv-vllm).

Item 4: unset decoding fields are left to the model (hf: its generation config, compared with
transformers' own `generate`; OpenAI/vLLM: not sent), and what was used is recorded."""
from __future__ import annotations

import asyncio
import json
import shutil
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from support.synthetic import LABEL_IDS, ROUND_IDS

from lhd_train.bench.accounting import usage_by_role
from lhd_train.bench.structured_calls import BackendUnavailable, ask_structured
from lhd_train.bench.supervisor import EvaluationAnswer
from lhd_train.config.run import Sampling
from lhd_train.rundir.rows import AuditRow, RoundRow
from rollouts.hf.spec import HFSpec
from rollouts.openai_backend import OpenAIBackend, OpenAISpec
from rollouts.structured import schema_for
from rollouts.types import GenerationRequest, SamplingParams, effective_sampling
from rollouts.vllm.spec import VLLMSpec

ROOT = Path(__file__).resolve().parents[2]
ASK = [{"role": "system", "content": "You are a manager."}, {"role": "user", "content": "Evaluate the report."}]


@pytest.fixture(scope="module")
def hf(tiny_llama_dir):
    from rollouts.hf import HFBackend

    return HFBackend.from_spec(HFSpec(model=str(tiny_llama_dir), batch_wait_ms=0))


class Server:
    """A real OpenAI-compatible endpoint on 127.0.0.1: every chat completion answers `content`
    with `finish_reason`, reporting `max_tokens` completion tokens; request bodies are kept."""

    def __init__(self, content: str = "", finish_reason: str = "length", delay_s: float = 0.0):
        self.content, self.finish_reason, self.delay_s = content, finish_reason, delay_s
        self.bodies: list[dict] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - the standard library's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.bodies.append(body)
                time.sleep(outer.delay_s)
                reply = json.dumps({
                    "id": f"c{len(outer.bodies)}", "object": "chat.completion", "created": 0, "model": body["model"],
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": outer.content},
                                 "finish_reason": outer.finish_reason}],
                    "usage": {"prompt_tokens": 20, "completion_tokens": body["max_tokens"],
                              "total_tokens": 20 + body["max_tokens"]},
                }).encode()
                try:
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(reply)))
                    self.end_headers()
                    self.wfile.write(reply)
                except OSError:  # the client gave up (the timeout test)
                    pass

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    s = Server()
    yield s
    s.close()


def ask(backend, max_tokens=8, attempts=3, sampling=None):
    sampling = sampling or (lambda a: SamplingParams(max_tokens=max_tokens, seed=a))
    return asyncio.run(ask_structured(backend, lambda note: [ASK[0], {"role": "user", "content": ASK[1]["content"]
                                                                       + note}],
                                      EvaluationAnswer, "evaluation", sampling, attempts, lambda m: []))


def test_hf_returns_a_cut_json_answer_as_cut(hf):
    """Old code: the guard closed every row within budget (finish "stop") by writing `", "trust": 0,
    "satisfaction": 0, "comfort": 0}` — values the model never chose."""
    schema = schema_for(EvaluationAnswer)
    reqs = [GenerationRequest(ASK[:1] + [{"role": "user", "content": f"Evaluate report {i}."}],
                              SamplingParams(temperature=1.0, max_tokens=24, seed=i), schema) for i in range(6)]
    results = asyncio.run(hf.generate(reqs))
    for r in results:
        c = r.completions[0]
        assert c.finish_reason == "length" and len(c.token_ids) == 24, c.text
        assert not c.text.rstrip().endswith("}"), c.text  # nothing closed it
    assert hf.stats["json_cut_rows"] >= 6


def test_the_same_cut_answer_has_the_same_outcome_on_hf_openai_and_vllm(hf, server):
    """One cut output, three paths: in-process hf, an OpenAI endpoint, and the vLLM request path
    (structured_outputs) of the same client: each ends `cut`, no value, every call recorded cut,
    and each retry asked for twice the budget (8, 16, 32). Old code: hf `ok` with invented numbers,
    the servers `failed` (parsed, never retried with more room)."""
    out_hf = ask(hf)
    server.content = out_hf.calls[0].raw  # the very text hf cut, served as a server would cut it
    openai_b = OpenAIBackend(OpenAISpec(model="m", base_url=server.url, max_retries=0), server.url)
    vllm_b = OpenAIBackend(VLLMSpec(model="m", max_retries=0), server.url, structured="vllm")
    out_openai, out_vllm = ask(openai_b), ask(vllm_b)
    assert [b["max_tokens"] for b in server.bodies] == [8, 16, 32] * 2
    assert "structured_outputs" in server.bodies[-1]  # the vLLM request form
    for out in (out_hf, out_openai, out_vllm):
        assert (out.status, out.value, sum(c.cut for c in out.calls)) == ("cut", None, 3)
        assert [c.finish_reason for c in out.calls] == ["length"] * 3
        assert [c.sampling.max_tokens if c.sampling else None for c in out.calls] == [8, 16, 32]
    first = [(o.calls[0].raw, o.calls[0].cut, o.calls[0].parse_error) for o in (out_hf, out_openai, out_vllm)]
    assert first[0] == first[1] == first[2]
    # A finished answer after a cut is used, and says it was retried.
    server.content, server.finish_reason = '{"reasoning": "fine", "trust": 0.5, "satisfaction": 0.4, "comfort": 0.1}', \
        "stop"
    ok = ask(openai_b, attempts=2)
    assert ok.status == "ok" and ok.value.trust == 0.5


def test_cut_retry_stays_within_the_context(server):
    """The doubled budget never passes the room the model's context leaves after the prompt."""
    spec = OpenAISpec(model="m", base_url=server.url, max_retries=0, max_model_len=400)
    b = OpenAIBackend(spec, server.url)
    server.content = '{"reasoning": "cut'
    ask(b, max_tokens=300, attempts=2)
    room = 400 - b.count_tokens(ASK)
    assert [x["max_tokens"] for x in server.bodies] == [300, room] and room < 600


def test_timeout_against_a_live_managed_server_is_not_asked_again(server):
    """Old code: `ask_structured` sent the request `max_attempts` times after the backend had said
    'not resubmitted' (each one a fresh wait at the back of the server's queue)."""
    server.delay_s = 1.5
    b = OpenAIBackend(VLLMSpec(model="m", timeout_s=0.3, max_retries=3), server.url)

    class Alive:
        def alive(self):
            return True

    b.server = Alive()
    with pytest.raises(BackendUnavailable, match="not resubmitted"):
        ask(b, attempts=3)
    time.sleep(0.2)
    assert len(server.bodies) == 1


def test_cut_answers_are_counted_per_role():
    call = {"prompt_tokens": 5, "completion_tokens": 8, "latency_s": 0.1}
    rows = [{
        **ROUND_IDS, "task_index": 1, "round": 1, "global_round": 1,
        "performer": {"text": "", "segments": 3, "truncated": True, "finish_reason": "length", "attempts": 1},
        "supervisor": {"calls": [
            {**call, "stage": "evaluation", "finish_reason": "length", "cut": True},
            {**call, "stage": "evaluation", "finish_reason": "stop", "cut": False},
            {**call, "stage": "feedback", "finish_reason": "length", "cut": True},
            {**call, "stage": "feedback", "finish_reason": "length", "cut": True},
            {**call, "stage": "summary", "finish_reason": "length"},  # a row written before the `cut` field
        ]},
    }]
    audits = [{**LABEL_IDS, "global_round": 1, "parse_status": "cut",
               "calls": [{**call, "stage": "audit", "finish_reason": "length", "cut": True}]}]
    u = usage_by_role([RoundRow.model_validate(r) for r in rows], [AuditRow.model_validate(a) for a in audits])
    assert (u["performer"]["cut_calls"], u["performer"]["cut_answers"]) == (3, 1)
    assert (u["supervisor"]["cut_calls"], u["supervisor"]["cut_answers"]) == (3, 1)
    assert (u["summariser"]["cut_calls"], u["summariser"]["cut_answers"]) == (1, 1)
    assert (u["auditor"]["cut_calls"], u["auditor"]["cut_answers"]) == (1, 1)


# ---------------------------------------------------------------- item 4: the model's own defaults

def test_role_sampling_defaults_are_the_models():
    s = Sampling()
    assert (s.temperature, s.top_p, s.top_k, s.repetition_penalty) == (None, None, None, None)
    assert s.max_tokens >= 4096  # room for a full structured answer (old: 512)
    p = s.params(seed=3)
    assert p.temperature is None and p.top_k is None and p.seed == 3
    assert p.resolved({"temperature": 0.6, "top_k": 20}).to_dict() | {"seed": 0} == {
        "temperature": 0.6, "top_p": 1.0, "top_k": 20, "repetition_penalty": 1.0, "max_tokens": s.max_tokens,
        "seed": 0, "n": 1}
    assert effective_sampling(p, None)["temperature"] is None  # unknown defaults: the provider's
    assert effective_sampling(p, {"temperature": 0.6})["temperature"] == 0.6


@pytest.fixture(scope="module")
def tiny_with_defaults(tiny_llama_dir, tmp_path_factory):
    """The tiny model whose generation_config.json sets top_k 1 and a repetition penalty."""
    out = tmp_path_factory.mktemp("tiny_gen_defaults") / "model"
    shutil.copytree(tiny_llama_dir, out)
    cfg = json.loads((out / "generation_config.json").read_text())
    (out / "generation_config.json").write_text(json.dumps(cfg | {"top_k": 1, "repetition_penalty": 1.3}))
    return out


def test_hf_decodes_with_the_models_generation_defaults(tiny_with_defaults):
    """A request that leaves top_k and repetition_penalty unset decodes with the model's (top_k 1:
    the most likely token after the penalty, whatever the temperature), token for token what
    transformers' own `generate` gives with that penalty. Old code ignored the model's defaults
    and sampled at temperature 1."""
    import torch
    from transformers import GenerationConfig

    from rollouts.hf import HFBackend

    b = HFBackend.from_spec(HFSpec(model=str(tiny_with_defaults), batch_wait_ms=0))
    assert b.describe()["generation_defaults"] == {"top_k": 1, "repetition_penalty": 1.3}
    msgs = [{"role": "user", "content": "Write the weekly status report."}]
    [res] = asyncio.run(b.generate([GenerationRequest(msgs, SamplingParams(temperature=1.0, max_tokens=30, seed=5))]))
    assert res.sampling == {"temperature": 1.0, "top_p": 1.0, "top_k": 1, "repetition_penalty": 1.3,
                            "max_tokens": 30, "seed": 5, "n": 1}
    ids = b.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, return_dict=False)
    gen = GenerationConfig(do_sample=False, repetition_penalty=1.3, max_new_tokens=30,
                           eos_token_id=b.stop_ids, pad_token_id=b.pad_id)
    with torch.inference_mode():
        out = b.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                               generation_config=gen)
    expected = out[0, len(ids):].tolist()
    stop = next((i for i, t in enumerate(expected) if t in b.stop_set), len(expected))
    assert res.completions[0].token_ids == expected[:stop]
    # A value the request sets wins over the model's.
    [own] = asyncio.run(b.generate([GenerationRequest(msgs, SamplingParams(temperature=0.0, top_k=0,
                                                                            repetition_penalty=1.0, max_tokens=8))]))
    assert own.sampling["top_k"] == 0 and own.sampling["repetition_penalty"] == 1.0


def test_openai_path_sends_only_what_the_config_sets(server):
    server.content, server.finish_reason = "hello", "stop"
    b = OpenAIBackend(VLLMSpec(model="m", max_retries=0), server.url)
    [res] = asyncio.run(b.generate([GenerationRequest(ASK, SamplingParams(max_tokens=9, seed=1))]))
    sent = server.bodies[-1]
    for unset in ("temperature", "top_p", "top_k", "repetition_penalty"):
        assert unset not in sent  # the server applies the model's defaults
    assert res.sampling == {"temperature": None, "top_p": None, "max_tokens": 9, "seed": 1, "n": 1, "top_k": None,
                            "repetition_penalty": None}
    asyncio.run(b.generate([GenerationRequest(ASK, SamplingParams(temperature=0.2, top_k=5, max_tokens=9))]))
    assert server.bodies[-1]["temperature"] == 0.2 and server.bodies[-1]["top_k"] == 5  # vLLM's extra field


VLLM_PROBE = """
import json, sys
from vllm.config import ModelConfig
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
model, body = sys.argv[1], json.loads(sys.argv[2])
defaults = ModelConfig(model=model, dtype="float32", max_model_len=256).get_diff_sampling_param()
sp = ChatCompletionRequest(**body).to_sampling_params(body["max_tokens"], defaults)
print(json.dumps({k: getattr(sp, k) for k in ("temperature", "top_p", "top_k", "repetition_penalty")}))
"""


@pytest.mark.vllm
def test_vllm_applies_the_model_defaults_to_what_we_send(tiny_with_defaults, vllm_python):
    """vLLM's own classes (.venv-vllm, the session's interpreter): the body our client sends with
    every decoding field unset, turned into vLLM sampling params with the model's generation config
    (vLLM's default `--generation-config auto`), decodes as our hf backend resolves the same request."""
    spec = VLLMSpec(model=str(tiny_with_defaults))
    b = OpenAIBackend(spec, "http://127.0.0.1:9/v1")
    body = b._payload(GenerationRequest(ASK, SamplingParams(max_tokens=9, seed=1)), "vllm")
    body |= body.pop("extra_body", {})  # what the SDK puts on the wire
    env = {"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    out = vllm_python.run([vllm_python.python, "-c", VLLM_PROBE, str(tiny_with_defaults), json.dumps(body)], env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    used = json.loads(out.stdout.strip().splitlines()[-1])
    ours = SamplingParams().resolved(b.describe()["generation_defaults"])
    assert b.describe()["generation_defaults"] == {"top_k": 1, "repetition_penalty": 1.3}
    assert used == {k: getattr(ours, k) for k in used}


def test_a_trial_records_cut_supervisor_answers_as_cut(hf, tmp_path):
    """A trial on the tiny model whose supervisor budget is far too small for an evaluation: every
    round says `cut`, its state stays as it was (nothing invented), the rows and the per-role
    counts show the cut calls. Old code: `ok` rows with trust, satisfaction and comfort 0."""
    from test_trial_loop import make_cfg, run

    cfg = make_cfg(tmp_path, max_tasks=2, max_rounds_per_task=1,
                   performer={"model": "m", "max_segments": 1, "sampling": {"max_tokens": 8}},
                   supervisor={"model": "m", "max_attempts": 2, "sampling": {"temperature": 1.0, "max_tokens": 6}})
    res, rows = run(cfg, hf)
    assert res.status == "done" and len(rows) == 2
    for row in rows:
        sup = row.supervisor
        assert sup.parse_status == "cut" and sup.evaluation is None and sup.feedback is None
        assert sup.state_after.to_json() == sup.state_before.to_json() == \
            {"trust": 0.0, "satisfaction": 0.0, "comfort": 0.0}
        assert [(c.cut, c.sampling.max_tokens) for c in sup.calls] == [(True, 6), (True, 12)]
        assert row.performer.sampling.top_p == 1.0  # what hf used: the model sets none
    u = usage_by_role(rows)
    assert (u["supervisor"]["cut_calls"], u["supervisor"]["cut_answers"]) == (4, 2)


def test_a_cut_summary_is_asked_again_with_more_room():
    """The memory summary is free text: cut at its limit, it is asked again with twice the budget;
    a summary still cut after `max_attempts` keeps the model's words with status `cut`."""
    from support.scripted import ScriptedBackend

    from lhd_train.bench.memory import Memory, RoundNote
    from lhd_train.bench.prompts import Prompts
    from lhd_train.bench.supervisor import Supervisor
    from rollouts.types import Completion, GenerationResult

    class Cutting(ScriptedBackend):
        def __init__(self, cut_first: int):
            super().__init__(lambda r: "")
            self.cut_first = cut_first

        async def generate(self, requests):
            self.requests += requests
            cut = len(self.requests) <= self.cut_first
            return [GenerationResult([Completion("a summary", [1, 2], "length" if cut else "stop")])]

    st = {"trust": 0.0, "satisfaction": 0.0, "comfort": 0.0}
    note = RoundNote(1, 1, "t", 1, None, "answer", "why", st, st, "fb", False, "prompt", None)
    for cut_first, status, budgets in ((1, "ok", [50, 100]), (3, "cut", [50, 100, 200])):
        b = Cutting(cut_first)
        sup = Supervisor(b, b, Prompts(), "pack", 0.2, 3, Memory(7), {}, max_attempts=3,
                         sampling=lambda stage, a: SamplingParams(max_tokens=50, seed=a))
        summary, calls = asyncio.run(sup._summarise(note))
        assert summary.status == status and summary.text == "a summary"
        assert [c.sampling.max_tokens if c.sampling else None for c in calls] == budgets
