"""The OpenAI-compatible path against a real server running here (`transformers serve` on the
tiny model): structured answers through the schema-in-prompt fallback, a server killed mid-run,
retries, and a trial resumed afterwards. The same supervision code launches `vllm serve` on GPUs."""
from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest
from support.http_json import send_json

import lhd_train.bench.engine as engine
from lhd_train.config.run import parse_config
from lhd_train.io.files import read_jsonl
from rollouts.backends import build_backend, parse_spec
from rollouts.openai_backend import OpenAISpec, _is_transient
from rollouts.vllm.server import vllm_command
from rollouts.vllm.spec import VLLMSpec

SECRET = "sk-test-9f8e7d6c5b4a-never-on-disk"


def config(tmp_path: Path, model_dir: Path):
    spec = {"backend": "transformers-serve", "model": str(model_dir), "max_retries": 2, "timeout_s": 60,
            "startup_timeout_s": 240, "api_key_env": "LHD_TEST_API_KEY"}
    return parse_config({
        "run_name": "served", "output_dir": str(tmp_path), "seeds": [3], "max_tasks": 2,
        "models": {"srv": spec}, "max_rounds_per_task": 2,
        "performer": {"model": "srv", "sampling": {"max_tokens": 12}},
        "supervisor": {"model": "srv", "sampling": {"max_tokens": 48}, "max_attempts": 2},
        "summariser": {"model": "srv", "sampling": {"max_tokens": 8}},
    }, "test")


@pytest.mark.slow
def test_server_killed_mid_run_then_resumed(tmp_path, tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("LHD_TEST_API_KEY", SECRET)
    built = []
    real_build = engine.build_backend

    def capture(spec, name="", log_dir=None):
        b = real_build(spec, name=name, log_dir=log_dir)
        built.append(b)
        return b

    monkeypatch.setattr(engine, "build_backend", capture)
    cfg = config(tmp_path, tiny_llama_dir)
    trial = cfg.run_dir / "trials" / "s3.jsonl"

    async def run_and_kill():
        task = asyncio.create_task(engine.run_benchmark(cfg, progress=False))
        while not read_jsonl(trial):
            await asyncio.sleep(0.05)
            assert not task.done(), task.result()
        server = built[0].server
        os.killpg(server.proc.pid, signal.SIGKILL)
        return await task

    [res] = asyncio.run(run_and_kill())
    assert res.status == "failed" and "Connection" in res.error
    assert built[0].stats["retries"] >= 1  # transient errors were retried before giving up
    kept = read_jsonl(trial)
    assert len(kept) >= 1

    # Resume on a fresh server: finished rounds are kept, the rest is completed.
    [res2] = asyncio.run(engine.run_benchmark(cfg, progress=False))
    assert res2.status == "done", res2.error
    rows = read_jsonl(trial)
    assert rows[: len(kept)] == kept
    assert [r["global_round"] for r in rows] == list(range(1, len(rows) + 1))
    for r in rows:
        assert r["supervisor"]["parse_status"] in ("ok", "retried", "cut", "failed")
        for call in r["supervisor"]["calls"]:
            if call["stage"] == "evaluation":
                assert call["error"] is None  # parse problems, not transport ones, once resumed
    # The schema reached the model through the prompt (transformers serve ignores response_format).
    msgs = (cfg.run_dir / "trials" / "s3.messages.jsonl").read_text()
    assert "matches this JSON schema" in msgs
    # The API key never reaches disk.
    for path in cfg.run_dir.rglob("*"):
        if path.is_file():
            assert SECRET not in path.read_text(errors="replace"), path
    assert all(not b.server.alive() for b in built)


def test_transient_classification():
    import httpx
    import openai

    req = httpx.Request("POST", "http://127.0.0.1/v1/chat/completions")

    def status_error(cls, code):
        return cls("x", response=httpx.Response(code, request=req), body=None)

    assert _is_transient(openai.APIConnectionError(request=req))
    assert _is_transient(status_error(openai.RateLimitError, 429))
    assert _is_transient(status_error(openai.InternalServerError, 503))
    assert not _is_transient(status_error(openai.BadRequestError, 400))
    assert not _is_transient(status_error(openai.AuthenticationError, 401))


def test_missing_api_key_env_is_a_clear_error(monkeypatch):
    from rollouts.backend import BackendError

    monkeypatch.delenv("LHD_NOPE_KEY", raising=False)
    spec = OpenAISpec(model="m", base_url="http://127.0.0.1:9/v1", api_key_env="LHD_NOPE_KEY")
    with pytest.raises(BackendError, match="LHD_NOPE_KEY"):
        spec.build()


def test_vllm_command_carries_the_spec():
    spec = VLLMSpec(model="/models/llama", revision="abc", dtype="bfloat16", max_model_len=32768,
                     tensor_parallel_size=2, gpu_memory_utilization=0.85, adapters={"honest": "/ad/h"},
                     enable_prefix_caching=True, device="cuda")
    cmd = vllm_command(spec, 8123, "perf")
    joined = " ".join(cmd)
    for part in ("serve /models/llama", "--port 8123", "--served-model-name perf", "--revision abc",
                 "--tensor-parallel-size 2", "--max-model-len 32768", "--enable-prefix-caching",
                 "--enable-lora", "honest=/ad/h", "--gpu-memory-utilization 0.85"):
        assert part in joined
    assert "--trust-remote-code" not in cmd


@pytest.fixture
def chat_server():
    """A real HTTP server on 127.0.0.1 that answers every chat request "fine" and keeps the bodies
    it received (as bytes)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    received: list[bytes] = []

    class Chat(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as real servers do

        def do_POST(self):
            received.append(self.rfile.read(int(self.headers["Content-Length"])))
            send_json(self, 200, {"id": "c", "object": "chat.completion", "created": 0, "model": "m",
                                  "choices": [{"index": 0, "finish_reason": "stop",
                                               "message": {"role": "assistant", "content": "fine"}}],
                                  "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}})

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Chat)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_port, received
    server.shutdown()


def test_one_backend_across_event_loops(caplog, chat_server):
    """Several `asyncio.run`s on one backend (a benchmark, a notebook): each loop gets its own
    client, and closing after the loops that used it are gone neither raises nor leaks. The old
    shared client kept keep-alive connections bound to a closed loop; `aclose` then failed with
    'Event loop is closed' and a managed vLLM server outlived the benchmark."""
    from rollouts.types import GenerationRequest

    spec = parse_spec({"backend": "openai", "model": "m",
                                     "base_url": f"http://127.0.0.1:{chat_server[0]}/v1"})
    backend = spec.build()
    req = GenerationRequest([{"role": "user", "content": "hi"}])
    import gc

    for _ in range(3):
        [res] = asyncio.run(backend.generate([req]))
        assert res.error is None and res.completions[0].text == "fine"
        gc.collect()
    asyncio.run(backend.aclose())  # raised RuntimeError('Event loop is closed') before
    gc.collect()
    # nor may a dropped client try to close itself on a later loop (asyncio would log that task's
    # failure); seen with managed vLLM in the throughput benchmark, not reproduced by this server
    assert not [r for r in caplog.records if "Event loop is closed" in r.getMessage()
                or "never retrieved" in r.getMessage()]


def test_a_lone_surrogate_in_a_message_is_sent_as_a_replacement_character(chat_server):
    """A performer answer holding a lone UTF-16 surrogate (kept exactly in the rows) goes back to the
    model in the next prompt. The SDK cannot UTF-8-encode it: before, every such request failed with
    UnicodeEncodeError, so the trial could never progress."""
    import json

    from rollouts.types import GenerationRequest

    port, received = chat_server
    backend = build_backend(OpenAISpec(model="m", base_url=f"http://127.0.0.1:{port}/v1"))
    req = GenerationRequest([{"role": "assistant", "content": "half \ud83d of a pair"},
                             {"role": "user", "content": "go on \udfff"}])
    [res] = asyncio.run(backend.generate([req]))
    assert res.error is None and res.completions[0].text == "fine", res.error
    sent = json.loads(received[-1].decode("utf-8"))["messages"]
    assert [m["content"] for m in sent] == ["half \ufffd of a pair", "go on \ufffd"]
    assert res.sent_messages == sent  # the row records what the model was shown
