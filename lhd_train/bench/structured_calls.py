"""Ask a model for a schema-shaped answer: fresh conversation per attempt, bounded attempts,
every attempt recorded. Parse failures end in a recorded `failed` status, never an invented
answer; transport failures raise so the round is redone on resume instead of being faked."""
from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel

from rollouts.backend import Backend
from rollouts.structured import parse_json_output, schema_for
from rollouts.types import GenerationRequest, GenerationResult, SamplingParams

M = TypeVar("M", bound=BaseModel)

RETRY_NOTE = (
    "\n\n(Your previous answer could not be used: {error}. Reply with one JSON object that "
    "matches this schema exactly, and nothing else: {schema})"
)


class BackendUnavailable(RuntimeError):
    """The model could not be reached after the backend's own retries."""


def call_seed(*parts: object) -> int:
    """A stable 31-bit sampling seed for one call, derived from the trial seed and the call's place."""
    return int.from_bytes(hashlib.sha256("/".join(map(str, parts)).encode()).digest()[:4], "big") & 0x7FFFFFFF


def call_record(stage: str, attempt: int, messages_ids: list[str], res: GenerationResult,
                sampling: SamplingParams, parse_error: str | None) -> dict[str, Any]:
    return {
        "stage": stage, "attempt": attempt, "message_ids": messages_ids, "raw": res.text,
        "finish_reason": res.completions[0].finish_reason if res.completions else None,
        "parse_error": parse_error, "error": res.error, "prompt_tokens": res.prompt_tokens,
        "completion_tokens": res.completion_tokens, "cached_tokens": res.cached_tokens,
        "latency_s": round(res.latency_s, 4), "sampling": sampling.to_dict(), "model": res.model_id,
    }


@dataclass
class StructuredOutcome:
    value: Any | None
    status: str  # ok | retried | failed
    calls: list[dict[str, Any]] = field(default_factory=list)


async def ask_structured(
    backend: Backend,
    build_messages: Callable[[str], list[dict[str, str]]],
    model_cls: type[M],
    stage: str,
    sampling_for: Callable[[int], SamplingParams],
    max_attempts: int,
    store_messages: Callable[[list[dict[str, str]]], list[str]],
    adapter: str | None = None,
) -> StructuredOutcome:
    """`build_messages(note)` returns a fresh conversation; `note` is "" on the first attempt and
    a repair instruction naming the last error afterwards."""
    schema = schema_for(model_cls)
    calls: list[dict[str, Any]] = []
    note = ""
    transport_errors = 0
    for attempt in range(1, max_attempts + 1):
        messages = build_messages(note)
        sampling = sampling_for(attempt)
        [res] = await backend.generate([GenerationRequest(messages, sampling, schema, adapter)])
        ids = store_messages(res.sent_messages or messages)
        if res.error is not None:
            calls.append(call_record(stage, attempt, ids, res, sampling, None))
            transport_errors += 1
            continue
        value, err = parse_json_output(res.text, model_cls)
        calls.append(call_record(stage, attempt, ids, res, sampling, err))
        if value is not None:
            return StructuredOutcome(value, "ok" if attempt == 1 else "retried", calls)
        note = RETRY_NOTE.format(error=err, schema=schema_json(schema))
    if transport_errors == max_attempts:
        raise BackendUnavailable(f"{stage}: {calls[-1]['error']}")
    return StructuredOutcome(None, "failed", calls)


def schema_json(schema: dict[str, Any]) -> str:
    import json

    return json.dumps(schema, separators=(",", ":"))
