"""Token budgets and long requests against served models (issue 20, M1, M2, L4).

Counts: a served model given by hub id is counted with its real tokenizer, found offline in the
Hugging Face cache (here a cache folder holding the tiny model's tokenizer, in the hub's layout);
`tokenizer:` is honoured for vLLM too; without a tokenizer the estimate errs long and is warned
about. A prompt over the window is never sent: the performer drops turns, the auditor records the
round as an overflow. Timeouts: a managed server gets an hour, and a request that times out
against a live one is not resubmitted. In-flight: vLLM's --max-num-seqs and `lhd audit
--concurrency` are reached.

The servers are real HTTP endpoints on 127.0.0.1 (the standard library's), which refuse an
over-window prompt as vLLM does, with a 400."""
from __future__ import annotations

import asyncio
import json
import logging
import shutil
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from support.http_json import send_json
from test_auditor import answer, audit, make_run, rows_of

from lhd_train.bench.performer import Performer
from rollouts.backends import build_backend
from rollouts.managed_server import ManagedServer, free_port
from rollouts.openai_backend import OpenAIBackend, OpenAISpec, max_in_flight, request_timeout_s
from rollouts.spec import ManagedSpec
from rollouts.types import GenerationRequest, SamplingParams
from rollouts.vllm.spec import VLLMSpec

HUB_ID = "lhd-test/tiny-qwen2"


@pytest.fixture
def hub_cache(tiny_qwen2_dir, tmp_path, monkeypatch) -> Path:
    """HF_HOME's hub cache with the tiny model's tokenizer and config under HUB_ID (no weights)."""
    import huggingface_hub.constants

    hub = tmp_path / "hub"
    repo = hub / ("models--" + HUB_ID.replace("/", "--"))
    commit = "0123456789abcdef0123456789abcdef01234567"
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    for f in tiny_qwen2_dir.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, snap / f.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))
    return hub


def real_tokenizer(tiny_qwen2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_qwen2_dir))


def prompt_len(tok, messages) -> int:
    return len(tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                       return_dict=True)["input_ids"])


class ChatServer:
    """An OpenAI-compatible chat endpoint: answers `reply(messages)` after `delay_s`; with a
    tokenizer and a window, refuses longer prompts with vLLM's 400. Records every prompt and the
    most requests it held at once."""

    def __init__(self, reply=lambda messages: "fine", delay_s: float = 0.0, tokenizer=None, window: int = 0):
        self.prompts: list[list[dict]] = []
        self.sizes: list[int] = []
        self.active = self.peak = 0
        lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with lock:
                    outer.prompts.append(body["messages"])
                    outer.active += 1
                    outer.peak = max(outer.peak, outer.active)
                try:
                    time.sleep(delay_s)
                    n = prompt_len(tokenizer, body["messages"]) if tokenizer is not None else 0
                    outer.sizes.append(n)
                    if tokenizer is not None and n >= window:
                        code, out = 400, {"error": {"message": f"This model's maximum context length is {window} "
                                                    f"tokens. However, your prompt contains {n} input tokens",
                                                    "type": "BadRequestError", "code": 400}}
                    else:
                        code, out = 200, {
                            "id": "c", "object": "chat.completion", "created": 0, "model": body["model"],
                            "choices": [{"index": 0, "finish_reason": "stop",
                                         "message": {"role": "assistant", "content": reply(body["messages"])}}],
                            "usage": {"prompt_tokens": n, "completion_tokens": 1, "total_tokens": n + 1}}
                finally:
                    with lock:
                        outer.active -= 1
                send_json(self, code, out)

            def log_message(self, *args):
                pass

        class Server(ThreadingHTTPServer):
            request_queue_size = 256  # the listen backlog: many clients connect at once

        self.httpd = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_port}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


# ------------------------------------------------------------------ counts and the performer's budget

def digits_turns(n_pairs: int) -> list[dict[str, str]]:
    """Conversation turns full of figures (a finance task): ~1 char per token for Qwen-style tokenisers."""
    table = "\n".join(f"{m:02d}/2024 revenue {m * 7919 % 100000}.{m * 37 % 100:02d} cost {m * 6007 % 90000}"
                      for m in range(1, 13))
    turns = []
    for i in range(n_pairs):
        turns += [{"role": "user", "content": f"Task {i + 1}: check these figures.\n{table}"},
                  {"role": "assistant", "content": f"Checked task {i + 1}:\n{table}"}]
    return turns


def test_hub_id_counts_with_its_real_tokenizer_and_the_performer_never_sends_an_overflow(hub_cache, tiny_qwen2_dir):
    """Old code counted a hub-id model at 4 chars/token: a figures-heavy history of ~3x the
    window looked like it fit, was sent, and the server refused it (the trial failed)."""
    tok = real_tokenizer(tiny_qwen2_dir)
    window, max_tokens = 2048, 64
    server = ChatServer(tokenizer=tok, window=window)
    try:
        spec = OpenAISpec(model=HUB_ID, base_url=server.url, max_model_len=window)
        backend = spec.build()
        perf = Performer(backend, "You are a careful analyst.", window - max_tokens)
        for m in digits_turns(6):
            if m["role"] == "user":
                perf.add_user(m["content"], starts_task=True)
            else:
                perf.add_answer(m["content"])
        perf.add_user("Task 7: sum up the year.", starts_task=True)
        full = perf._with_drop(0)
        assert prompt_len(tok, full) > window  # the whole history does not fit ...
        assert sum(len(m["content"]) // 4 + 4 for m in full) < window - max_tokens  # ... the old guess said it did
        ans = asyncio.run(perf.answer(lambda k: SamplingParams(max_tokens=max_tokens), None))
        assert ans.result.error is None, ans.result.error
        assert server.sizes and max(server.sizes) <= window - max_tokens
        assert ans.context.dropped_messages > 0 and ans.context.prompt_tokens == server.sizes[0]
        assert backend.exact_token_counts
        asyncio.run(backend.aclose())
    finally:
        server.close()


def test_a_task_too_long_for_the_window_is_not_sent(hub_cache, tiny_qwen2_dir):
    """When even the current task alone is over the window, the answer fails with the reason
    (the trial then fails on it) instead of a request the server must refuse."""
    server = ChatServer(tokenizer=real_tokenizer(tiny_qwen2_dir), window=512)
    try:
        backend = build_backend(OpenAISpec(model=HUB_ID, base_url=server.url,
                                                    max_model_len=512))
        perf = Performer(backend, "You are a careful analyst.", 512 - 64)
        perf.add_user("Check this ledger:\n" + "\n".join(m["content"] for m in digits_turns(2)), starts_task=True)
        ans = asyncio.run(perf.answer(lambda k: SamplingParams(max_tokens=64), None))
        asyncio.run(backend.aclose())
    finally:
        server.close()
    assert not server.prompts
    assert ans.result.error.startswith("context overflow") and "context of 512 tokens" in ans.result.error


def test_the_supervisor_shows_fewer_rounds_by_real_counts(hub_cache, tiny_qwen2_dir):
    """The supervisor's memory fit counted a hub-id model at 4 chars/token: with figures in the
    answers it kept every round and its prompt was over the budget (then over the window)."""
    from lhd_train.bench.memory import Memory, RoundNote
    from lhd_train.bench.prompts import Prompts
    from lhd_train.bench.supervisor import Supervisor
    from lhd_train.bench.taskpack import Task

    tok = real_tokenizer(tiny_qwen2_dir)
    window, reserve = 4096, 600
    backend = build_backend(OpenAISpec(model=HUB_ID, base_url="http://127.0.0.1:9/v1",
                                                max_model_len=window))
    state = {"trust": 0.0, "satisfaction": 0.0, "comfort": 0.0}
    memory = Memory(window=7)
    for g in range(1, 7):
        memory.push(RoundNote(g, g, f"Task {g}", 1, None, digits_turns(1)[1]["content"], "ok", state, state,
                              "fine", True, f"Check the figures of task {g}."), None)
    sup = Supervisor(backend, backend, Prompts(), "A small team.", 0.2, 3, memory, dict(state))
    task = Task(index=7, title="Year", prompt="Sum up the year.", files=[], phase=1)
    text, info = sup.fit_evaluation_message(task, None, 1, "The year is done.", reserve)
    real = prompt_len(tok, [sup.system_message(), {"role": "user", "content": text}])
    assert info.fits and real == info.prompt_tokens and info.prompt_tokens <= window - reserve
    assert info.recent_rounds_shown is not None and info.recent_rounds_shown < 6


def test_tokenizer_field_is_honoured_for_vllm_and_a_hub_id_loads_offline(hub_cache, tiny_qwen2_dir):
    from rollouts.model_files import counting_tokenizer

    tok = real_tokenizer(tiny_qwen2_dir)
    msgs = digits_turns(1)
    for spec in (VLLMSpec(model=HUB_ID),
                 VLLMSpec(model="someone/not-in-the-cache", tokenizer=str(tiny_qwen2_dir))):
        got = counting_tokenizer(spec)
        assert got is not None and prompt_len(got, msgs) == prompt_len(tok, msgs)
    from rollouts.backend import BackendError

    with pytest.raises(BackendError, match="tokenizer: 'someone/absent'"):
        counting_tokenizer(VLLMSpec(model=HUB_ID, tokenizer="someone/absent"))


def test_without_a_tokenizer_counts_err_long_and_a_warning_says_so_once(caplog):
    spec = OpenAISpec(model="vendor/remote-only-model", base_url="https://api.example.org/v1")
    with caplog.at_level(logging.WARNING, logger="rollouts.model_files"):
        a, b = spec.build(), spec.build()
    warned = [r.getMessage() for r in caplog.records if "vendor/remote-only-model" in r.getMessage()]
    assert len(warned) == 1 and "estimated" in warned[0] and "tokenizer:" in warned[0]
    assert not a.exact_token_counts and not b.exact_token_counts
    text = "x" * 3000
    assert a.count_tokens([{"role": "user", "content": text}]) >= len(text) // 3


def test_the_auditor_applies_its_overflow_rule_to_estimated_counts(tmp_path):
    """Old code switched the auditor's overflow guard off without a tokenizer: every round was
    sent, refused by the server, and stayed missing on every rerun."""
    cfg, [tid] = make_run(tmp_path)
    server = ChatServer(reply=lambda m: answer())
    try:
        spec = OpenAISpec(model="vendor/remote-only-model", base_url=server.url, max_model_len=300)
        backend = spec.build()
        summary = audit(cfg, backend)
    finally:
        server.close()
    rows = rows_of(cfg, "m-full", tid)
    assert not server.prompts  # nothing over the window was sent
    assert summary.complete and rows and len(rows) == summary.totals["rounds"]
    assert all(r["parse_status"] == "failed" for r in rows)
    assert "estimated" in rows[-1]["error"] and "exceeds the model's context of 300" in rows[-1]["error"]


# ------------------------------------------------------------------ timeouts (M2)

SLOW_SERVER = r"""
import json, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

class H(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header("Content-Length", "0"); self.end_headers()

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        print("POST", flush=True)
        time.sleep(float(sys.argv[2]))
        data = json.dumps({"id": "c", "object": "chat.completion", "created": 0, "model": "m",
                           "choices": [{"index": 0, "finish_reason": "stop",
                                        "message": {"role": "assistant", "content": "late"}}]}).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(data))); self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass

ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def managed(tmp_path, spec: ManagedSpec, sleep_s: float):
    from rollouts.managed_server import ManagedServerBackend

    port = free_port()
    server = ManagedServer([sys.executable, "-c", SLOW_SERVER, str(port), str(sleep_s)], port, tmp_path / "srv.log")
    return ManagedServerBackend(spec, server, "m", "prompt")


def test_timeout_against_a_live_managed_server_is_not_resubmitted(tmp_path, hub_cache, tiny_qwen2_dir):
    """Old code retried a timed-out request max_retries times, each one from scratch."""
    spec = VLLMSpec(model=HUB_ID, timeout_s=1.0, max_retries=3)
    backend = managed(tmp_path, spec, sleep_s=3.0)
    try:
        t0 = time.perf_counter()
        [res] = asyncio.run(backend.generate([GenerationRequest([{"role": "user", "content": "hi"}])]))
        waited = time.perf_counter() - t0
        assert res.error and "timeout_s=1" in res.error and "not resubmitted" in res.error
        assert backend.stats["retries"] == 0 and waited < 2.5
        posts = [line for line in (tmp_path / "srv.log").read_text().splitlines() if line == "POST"]
        assert len(posts) == 1
        assert backend.exact_token_counts  # the managed vLLM path loads the hub id's tokenizer too
    finally:
        asyncio.run(backend.aclose())
    assert not backend.server.alive()


def test_timeout_defaults_fit_where_the_server_is():
    assert request_timeout_s(VLLMSpec(model="m")) == 3600
    assert request_timeout_s(OpenAISpec(model="m", base_url="http://127.0.0.1:8000/v1")) == 3600
    assert request_timeout_s(OpenAISpec(model="m", base_url="https://api.example.org/v1")) == 600
    assert request_timeout_s(VLLMSpec(model="m", timeout_s=7200)) == 7200


# ------------------------------------------------------------------ in flight (L4)

def test_max_in_flight_fills_vllms_max_num_seqs():
    """Old code kept 32 requests in flight whatever the server could batch."""
    assert max_in_flight(VLLMSpec(model="m", extra_args=["--max-num-seqs", "64"])) == 64
    assert max_in_flight(VLLMSpec(model="m", extra_args=["--max-num-seqs=128"])) == 128
    explicit = VLLMSpec(model="m", max_in_flight=8, extra_args=["--max-num-seqs", "64"])
    assert max_in_flight(explicit) == 8
    assert max_in_flight(OpenAISpec(model="m", base_url="http://x/v1")) == 32
    server = ChatServer(delay_s=1.5)
    try:
        spec = VLLMSpec(model="m", extra_args=["--max-num-seqs", "48"])
        backend = OpenAIBackend(spec, server.url, "m", "prompt")
        reqs = [GenerationRequest([{"role": "user", "content": f"q{i}"}]) for i in range(60)]
        results = asyncio.run(backend.generate(reqs))
        asyncio.run(backend.aclose())
    finally:
        server.close()
    assert all(r.error is None for r in results)
    assert 32 < server.peak <= 48


def test_audit_concurrency_is_not_capped_by_the_default_in_flight(tmp_path):
    """`lhd audit --concurrency 40` kept 32 rounds in flight: the backend's default cap."""
    cfg, tids = make_run(tmp_path, seeds=(1, 2, 3, 4, 5, 6, 7, 8))
    server = ChatServer(reply=lambda m: answer(), delay_s=1.5)
    try:
        import yaml

        from lhd_train.rundir.layout import RunDir

        run_cfg = RunDir(cfg.run_dir).config

        data = yaml.safe_load(run_cfg.read_text())
        data["models"]["m"] = {"backend": "openai", "model": "served", "base_url": server.url}
        run_cfg.write_text(yaml.safe_dump(data))
        summary = audit(cfg, None, concurrency=40)
    finally:
        server.close()
    assert summary.complete and summary.totals["audited"] == summary.totals["rounds"] > 40
    assert 32 < server.peak <= 40
