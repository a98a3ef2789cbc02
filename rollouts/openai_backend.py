"""Any OpenAI-compatible chat endpoint: remote APIs, an existing `vllm serve`, `transformers serve`.

Bounded in-flight requests, timeouts (queue time included: an hour for a managed or local server,
ten minutes for a remote API) and retries of transient failures only; a request that timed out
against a live managed server is not resubmitted. API keys come from the environment variable the
config names and are never stored or logged: error texts have them and `base_url`'s credentials
replaced by ***; a lone UTF-16 surrogate is sent as U+FFFD. Unset decoding fields are not sent.
docs/serving.md ("Prompt lengths, time limits", "Retries and decoding defaults") gives the why."""
from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import urlparse

from pydantic import field_serializer
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, stop_after_attempt, wait_random_exponential

from rollouts.backend import BackendError
from rollouts.model_files import counting_tokenizer, estimate_tokens
from rollouts.spec import CheckRow, ServedSpec, public_url, redact, url_secrets
from rollouts.types import Completion, GenerationRequest, GenerationResult, sendable

if TYPE_CHECKING:
    from rollouts.backend import Backend

SCHEMA_NOTE = "\n\nReply with one JSON object, and nothing else, that matches this JSON schema:\n{schema}"
LOCAL_TIMEOUT_S = 3600.0  # managed or local servers: long prompts wait in a queue behind each other
REMOTE_TIMEOUT_S = 600.0
# Before the n-th resend: a uniform random wait in 0 .. min(30, 2**(n-1)) s ("full jitter").
RETRY_WAIT = wait_random_exponential(multiplier=1, max=30)


class OpenAISpec(ServedSpec):
    """An OpenAI-compatible endpoint that someone else runs (an API, a `vllm serve` of another job)."""

    backend: Literal["openai"] = "openai"
    base_url: str | None = None

    @field_serializer("base_url", when_used="json")
    def _public_base_url(self, v: str | None) -> str | None:
        """Written forms (config.resolved.yaml, manifest.json, auditor.json) never hold credentials."""
        return public_url(v)

    def build(self, name: str = "", log_dir: str | None = None) -> Backend:
        if not self.base_url:
            raise BackendError(f"model '{self.model}': backend openai needs base_url")
        return OpenAIBackend(self, self.base_url, tokenizer=counting_tokenizer(self))

    def placement(self, cuda: bool) -> str:
        return f"remote endpoint {public_url(self.base_url)} ({self.model}), no GPU here"

    @classmethod
    def config_rows(cls, specs: Any, config: str, gpu_gib: float | None = None) -> list[CheckRow]:
        return [(f"structured outputs {key}", "ok", "sends vLLM's `structured_outputs` field: a server older than "
                 "vLLM 0.10.2 ignores it silently and answers unconstrained (lhd then parses and retries); for such "
                 "a server use structured_outputs: response_format")
                for key, spec in specs.items() if spec.structured_outputs == "vllm"]


def is_local_server(spec: ServedSpec, base_url: str | None = None) -> bool:
    """A server lhd starts, or one on this machine (loopback address; default: the entry's own URL)."""
    host = urlparse(base_url or getattr(spec, "base_url", None) or "").hostname or ""
    return spec.managed or host in ("localhost", "::1") or host.startswith("127.")


def request_timeout_s(spec: ServedSpec, base_url: str | None = None) -> float:
    """`timeout_s`, or the default for where the server is."""
    if spec.timeout_s is not None:
        return spec.timeout_s
    return LOCAL_TIMEOUT_S if is_local_server(spec, base_url) else REMOTE_TIMEOUT_S


def max_in_flight(spec: ServedSpec) -> int:
    """`max_in_flight`, or the backend's default (vLLM: its `--max-num-seqs`; otherwise 32)."""
    return spec.max_in_flight or spec.default_in_flight()


def sent_sampling(body: dict[str, Any]) -> dict[str, Any]:
    """The decoding fields a request body sends; an unset one is None (the server's default)."""
    extra = body.get("extra_body") or {}
    keys = ("temperature", "top_p", "max_tokens", "seed", "n", "top_k", "repetition_penalty")
    return {k: body.get(k, extra.get(k)) for k in keys}


def _is_transient(exc: BaseException) -> bool:
    import openai

    if isinstance(exc, (openai.APIConnectionError, openai.APITimeoutError, openai.RateLimitError,
                        openai.InternalServerError)):
        return True
    status = getattr(exc, "status_code", None)
    return isinstance(status, int) and (status == 429 or status >= 500)


class OpenAIBackend:
    """`structured_outputs` picks how a JSON schema reaches the server: `response_format`
    (OpenAI's json_schema), `vllm` (vLLM's `structured_outputs` request field), or `prompt`
    (schema written into the prompt; the caller validates and repairs). `auto` starts with
    `response_format` and falls back to `prompt` if the server rejects it."""

    def __init__(self, spec: ServedSpec, base_url: str, served_name: str | None = None,
                 structured: str | None = None, tokenizer: Any = None):
        import openai

        self.spec = spec
        self.base_url = base_url
        self.timeout_s = request_timeout_s(spec, base_url)
        self.max_in_flight = max_in_flight(spec)
        self.server: Any = None  # a ManagedServer, for the backends that start their own
        self.model_id = served_name or spec.model
        self.max_model_len = spec.max_model_len
        self.structured = structured or spec.structured_outputs
        if self.structured == "auto":
            self.structured = "response_format"
        self.api_key_env = api_key_env = spec.api_key_env
        key = "EMPTY"
        if api_key_env:
            if api_key_env not in os.environ:
                raise BackendError(f"model '{spec.model}': environment variable {api_key_env} "
                                   "(api_key_env) is not set")
            key = os.environ[api_key_env]
        self._secrets = ([key] if api_key_env else []) + url_secrets(base_url)
        # Our own httpx client: the SDK's default one, when dropped, schedules its own close on whatever
        # loop is running, which fails ("Event loop is closed") for a client of an earlier loop.
        def new_client() -> openai.AsyncOpenAI:
            return openai.AsyncOpenAI(base_url=base_url, api_key=key, timeout=self.timeout_s, max_retries=0,
                                      http_client=openai.DefaultAsyncHttpxClient(timeout=self.timeout_s))

        self._new_client = new_client
        # One client and gate per event loop: a caller that runs several `asyncio.run`s on one backend
        # (a benchmark, a notebook) must not reuse connections bound to a loop that is closed.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._client: Any = None
        self._gate: asyncio.Semaphore | None = None
        self._tokenizer = tokenizer
        self._tok_lock = threading.Lock()  # callers count tokens from worker threads
        self.stats = {"requests": 0, "retries": 0, "failures": 0}

    def served_window(self, timeout_s: float = 10.0) -> int | None:
        """The context window the endpoint serves the model with: the `max_model_len` of its entry at
        `GET {base_url}/models` (vLLM lists it on every model card; one server has one window, so
        another card's value is used when the name is not listed). None when the endpoint does not
        say (an API that lists no window) or cannot be reached."""
        import httpx

        headers = {}
        if self.api_key_env and os.environ.get(self.api_key_env):
            headers["Authorization"] = f"Bearer {os.environ[self.api_key_env]}"
        try:
            r = httpx.get(self.base_url.rstrip("/") + "/models", headers=headers, timeout=timeout_s)
            r.raise_for_status()
            cards = r.json().get("data") or []
        except (httpx.HTTPError, ValueError, AttributeError):
            return None
        windows = {c.get("id"): c.get("max_model_len") for c in cards if isinstance(c, dict)}
        window = windows.get(self.model_id)
        if not isinstance(window, int):
            window = next((w for w in windows.values() if isinstance(w, int)), None)
        return window if isinstance(window, int) and window > 0 else None

    @property
    def exact_token_counts(self) -> bool:
        """Whether `count_tokens` uses the model's tokenizer (else it estimates)."""
        return self._tokenizer is not None

    def count_tokens(self, messages: list[dict[str, str]]) -> int:
        """Exact with a tokenizer; otherwise a conservative estimate (3 chars per token)."""
        if self._tokenizer is not None:
            with self._tok_lock:
                return len(self._tokenizer.apply_chat_template(
                    messages, tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"])
        return estimate_tokens(messages)

    def describe(self) -> dict[str, Any]:
        return {"backend": "openai", "model": self.model_id, "revision": self.spec.revision,
                "base_url": public_url(self.base_url), "api_key_env": self.api_key_env,
                "structured_outputs": self.structured, "timeout_s": self.timeout_s,
                "max_in_flight": self.max_in_flight, "exact_token_counts": self.exact_token_counts,
                "generation_defaults": self.spec.served_defaults()}

    async def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        return list(await asyncio.gather(*(self._one(r) for r in requests)))

    def _payload(self, req: GenerationRequest, mode: str) -> dict[str, Any]:
        messages = [{**m, "content": sendable(m["content"])} if isinstance(m.get("content"), str) else dict(m)
                    for m in req.messages]
        sp = req.sampling
        body: dict[str, Any] = {"model": req.adapter or self.model_id, "messages": messages,
                                "max_tokens": sp.max_tokens, "n": sp.n}
        body |= {k: getattr(sp, k) for k in ("temperature", "top_p", "seed") if getattr(sp, k) is not None}
        extra: dict[str, Any] = {k: getattr(sp, k) for k in ("top_k", "repetition_penalty")
                                 if getattr(sp, k) is not None}
        if req.json_schema is not None:
            if mode == "response_format":
                body["response_format"] = {"type": "json_schema",
                                           "json_schema": {"name": "answer", "schema": req.json_schema, "strict": True}}
            elif mode == "vllm":
                extra["structured_outputs"] = {"json": req.json_schema}
            else:
                messages[-1]["content"] += SCHEMA_NOTE.format(schema=json.dumps(req.json_schema))
        if extra:
            body["extra_body"] = extra
        return body

    async def _one(self, req: GenerationRequest) -> GenerationResult:
        t0 = time.perf_counter()
        client, gate = self._for_running_loop()
        async with gate:
            retrying = AsyncRetrying(retry=retry_if_exception(self._resend), wait=RETRY_WAIT, reraise=True,
                                     stop=stop_after_attempt(self.spec.max_retries + 1), before_sleep=self._count_retry)
            try:
                sent: tuple[Any, dict[str, Any]] = await retrying(self._send, client, req)
            except Exception as e:  # noqa: BLE001 - every failure becomes a result, as the protocol says
                return self._failure(e, t0)
        resp, body = sent
        res = self._result(resp, t0)
        res.sampling = sent_sampling(body)
        if body["messages"] != req.messages:
            res.sent_messages = body["messages"]
        return res

    async def _send(self, client: Any, req: GenerationRequest) -> tuple[Any, dict[str, Any]]:
        """One request; in `auto` mode a server that refuses `response_format` is sent it again at
        once with the schema in the prompt, and so is every later request."""
        import openai

        self.stats["requests"] += 1
        body = self._payload(req, self.structured)
        try:
            return await client.chat.completions.create(**body), body
        except openai.BadRequestError as e:
            if not ("response_format" in body and self.spec.structured_outputs == "auto"
                    and "response_format" in str(e)):
                raise
        self.structured = "prompt"
        self.stats["requests"] += 1
        body = self._payload(req, "prompt")
        return await client.chat.completions.create(**body), body

    def _dropped_by_live_server(self, exc: BaseException) -> bool:
        """A timeout from a managed server that still runs: it dropped the request's work, so a
        resubmission would start from scratch at the back of the same queue."""
        import openai

        return isinstance(exc, openai.APITimeoutError) and self.server is not None and self.server.alive()

    def _resend(self, exc: BaseException) -> bool:
        return _is_transient(exc) and not self._dropped_by_live_server(exc)

    def _count_retry(self, state: RetryCallState) -> None:
        self.stats["retries"] += 1

    def _failure(self, exc: BaseException, t0: float) -> GenerationResult:
        if not self._dropped_by_live_server(exc):
            return self._fail(f"{type(exc).__name__}: {exc}", t0)
        res = self._fail(f"{type(exc).__name__}: no answer within timeout_s={self.timeout_s:.0f} s from the managed "
                         "server, which is still running (the time includes its queue); not resubmitted, as the "
                         "server dropped the request's work: raise timeout_s or lower max_in_flight", t0)
        res.resubmit = False
        return res

    def _fail(self, msg: str, t0: float) -> GenerationResult:
        self.stats["failures"] += 1
        return GenerationResult([], latency_s=time.perf_counter() - t0, model_id=self.model_id,
                                error=redact(msg, self._secrets))

    def _result(self, resp: Any, t0: float) -> GenerationResult:
        comps = [Completion(c.message.content or "", None, c.finish_reason or "stop") for c in resp.choices]
        usage = resp.usage
        cached = 0
        if usage is not None and getattr(usage, "prompt_tokens_details", None) is not None:
            cached = usage.prompt_tokens_details.cached_tokens or 0
        return GenerationResult(
            comps, prompt_tokens=getattr(usage, "prompt_tokens", 0) or 0,
            completion_tokens=getattr(usage, "completion_tokens", 0) or 0, cached_tokens=cached,
            latency_s=time.perf_counter() - t0, model_id=self.model_id,
        )

    def _for_running_loop(self) -> tuple[Any, asyncio.Semaphore]:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            # the previous loop's client is dropped, not closed: closing needs that loop, and it is gone
            self._loop, self._client = loop, self._new_client()
            self._gate = asyncio.Semaphore(self.max_in_flight)
        assert self._gate is not None
        return self._client, self._gate

    async def aclose(self) -> None:
        if self._client is not None and self._loop is asyncio.get_running_loop():
            await self._client.close()
        self._client = self._loop = self._gate = None
