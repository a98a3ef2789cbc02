"""Resends of the OpenAI-compatible backend (tenacity's retries, the SDK's turned off), against a
local endpoint that answers as scripted: a transient failure (503, 429) is sent again up to
`max_retries` times, a client error (400) never; in `auto` mode a server that refuses
`response_format` gets the request once more with the schema in the prompt, and every later
request goes that way. (A timeout from a managed server that is still alive is not resubmitted:
tests/rollouts/test_token_budget.py.)"""
from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from support.http_json import send_json
from tenacity import wait_none

from rollouts import openai_backend
from rollouts.openai_backend import OpenAISpec
from rollouts.types import GenerationRequest

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


class Scripted:
    """Answers each POST with the next (status, message) of `script`, then 200 with `{"a": 1}`;
    records every body."""

    def __init__(self, script: list[tuple[int, str]]):
        self.bodies: list[dict] = []
        outer, script = self, list(script)

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):
                outer.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                code, message = script.pop(0) if script else (200, "")
                out = ({"error": {"message": message, "type": "error", "code": code}} if code != 200 else
                       {"id": "c", "object": "chat.completion", "created": 0, "model": "m",
                        "choices": [{"index": 0, "finish_reason": "stop",
                                     "message": {"role": "assistant", "content": '{"a": 1}'}}],
                        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}})
                send_json(self, code, out)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_port}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(autouse=True)
def no_waiting(monkeypatch):
    monkeypatch.setattr(openai_backend, "RETRY_WAIT", wait_none())


def ask(script: list[tuple[int, str]], n: int = 1, **spec):
    server = Scripted(script)
    try:
        backend = OpenAISpec(model="m", base_url=server.url, **spec).build()
        req = GenerationRequest([{"role": "user", "content": "hi"}], json_schema=SCHEMA)
        results = [asyncio.run(backend.generate([req]))[0] for _ in range(n)]
        return results, server.bodies, backend
    finally:
        server.close()


@pytest.mark.parametrize("retries", [0, 1, 3])
def test_transient_failures_are_sent_again_max_retries_times(retries):
    [res], bodies, backend = ask([(503, "overloaded")] * 9, max_retries=retries)
    assert len(bodies) == retries + 1 and backend.stats["retries"] == retries
    assert res.error and "InternalServerError" in res.error


def test_a_request_that_fails_twice_then_succeeds_is_answered():
    [res], bodies, backend = ask([(429, "slow down"), (502, "bad gateway")], max_retries=2)
    assert res.error is None and res.completions[0].text == '{"a": 1}'
    assert len(bodies) == 3 and backend.stats == {"requests": 3, "retries": 2, "failures": 0}


def test_a_client_error_is_not_sent_again():
    [res], bodies, backend = ask([(400, "bad request: no such model")], max_retries=5)
    assert len(bodies) == 1 and backend.stats["retries"] == 0
    assert "BadRequestError" in res.error and "no such model" in res.error


def test_a_server_that_refuses_response_format_gets_the_schema_in_the_prompt():
    refusal = (400, "response_format json_schema is not supported by this server")
    results, bodies, backend = ask([refusal], n=2, max_retries=0)
    assert [r.error for r in results] == [None, None]
    first, resent, later = bodies
    assert "response_format" in first and "response_format" not in resent and "response_format" not in later
    for body in (resent, later):
        assert json.dumps(SCHEMA) in body["messages"][-1]["content"]  # the schema note in the prompt
    assert backend.describe()["structured_outputs"] == "prompt" and backend.stats["retries"] == 0
    # a refusal of something else, or in a mode the config fixed, is a failure
    [res], bodies, _ = ask([refusal], structured_outputs="response_format")
    assert len(bodies) == 1 and "response_format" in res.error
