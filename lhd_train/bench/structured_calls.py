"""Ask a model for a schema-shaped answer: fresh conversation per attempt, bounded attempts,
every attempt recorded. A value comes only from an answer the model finished itself: parse
failures end in a recorded `failed` status, and an answer cut at its token limit
(finish_reason "length") is never parsed, since its last fields were never written. Such an
attempt is *cut*: the next attempt gets twice the token budget (within the model's context), and
when the last attempt is cut too the outcome is `cut`. The same cut text gives the same outcome on
every backend (the `hf` backend returns a cut JSON document as vLLM does, rollouts/hf/json_guard.py).
Transport failures raise so the round is redone on resume instead of being faked; a failure that
the backend says must not be resubmitted (a live managed server timed out) ends the attempts at once."""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel

from lhd_train.rundir.rows import CallRecord, SamplingRecord
from rollouts.backend import Backend
from rollouts.structured import parse_json_output, schema_for
from rollouts.types import GenerationRequest, GenerationResult, SamplingParams

M = TypeVar("M", bound=BaseModel)

RETRY_NOTE = (
    "\n\n(Your previous answer could not be used: {error}. Reply with one JSON object that "
    "matches this schema exactly, and nothing else: {schema})"
)
#: Outcome statuses, best first (`worst` picks the last of several).
STATUSES = ("ok", "retried", "cut", "failed")
CUT_ERROR = "cut at the token limit (finish_reason length) after {n} tokens"


class BackendUnavailable(RuntimeError):
    """The model could not be reached after the backend's own retries. Internal to the stages:
    `run_trial` and the audit runner catch it and record the trial or round as not done (a rerun
    resumes); it never reaches the error boundary, so it is not an `LhdError`."""


def call_seed(*parts: object) -> int:
    """A stable 31-bit sampling seed for one call, derived from the trial seed and the call's place."""
    return int.from_bytes(hashlib.sha256("/".join(map(str, parts)).encode()).digest()[:4], "big") & 0x7FFFFFFF


def is_cut(res: GenerationResult) -> bool:
    """The answer stopped at its token limit, not by the model's choice."""
    return res.error is None and bool(res.completions) and res.completions[0].finish_reason == "length"


def call_record(stage: str, attempt: int, messages_ids: list[str], res: GenerationResult,
                sampling: SamplingParams, parse_error: str | None) -> CallRecord:
    """One model call as a row records it. `sampling` is what the backend used (`res.sampling`:
    unset fields resolved by `hf`, or as sent to a server) when it says, else what was asked."""
    return CallRecord(
        stage=stage, attempt=attempt, message_ids=messages_ids, raw=res.text,
        finish_reason=res.completions[0].finish_reason if res.completions else None,
        cut=is_cut(res),
        parse_error=parse_error, error=res.error, prompt_tokens=res.prompt_tokens,
        completion_tokens=res.completion_tokens, cached_tokens=res.cached_tokens,
        latency_s=round(res.latency_s, 4),
        sampling=SamplingRecord.model_validate(res.sampling or sampling.to_dict()), model=res.model_id,
    )


@dataclass
class StructuredOutcome:
    value: Any | None
    status: str  # ok | retried | cut | failed (STATUSES)
    calls: list[CallRecord] = field(default_factory=list)


def worst(*statuses: str) -> str:
    return max(statuses, key=STATUSES.index)


async def budget_after_cuts(backend: Backend, messages: list[dict[str, str]], sampling: SamplingParams,
                            cuts: int) -> SamplingParams:
    """`sampling` with max_tokens doubled once per earlier cut attempt, but never past the room
    the model's context leaves after this prompt (when the backend knows its context)."""
    if cuts == 0:
        return sampling
    want = sampling.max_tokens * 2 ** cuts
    limit = getattr(backend, "max_model_len", None)
    if limit:
        room = limit - await asyncio.to_thread(backend.count_tokens, messages)
        want = max(sampling.max_tokens, min(want, room))
    return dataclasses.replace(sampling, max_tokens=want)


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
    after a cut one (the same prompt, a larger budget), and a repair instruction naming the last
    parse error after a failed one."""
    schema = schema_for(model_cls)
    calls: list[CallRecord] = []
    note = ""
    transport_errors = cuts = 0
    last = "failed"
    for attempt in range(1, max_attempts + 1):
        messages = build_messages(note)
        sampling = await budget_after_cuts(backend, messages, sampling_for(attempt), cuts)
        [res] = await backend.generate([GenerationRequest(messages, sampling, schema, adapter)])
        ids = store_messages(res.sent_messages or messages)
        if res.error is not None:
            calls.append(call_record(stage, attempt, ids, res, sampling, None))
            transport_errors += 1
            if not res.resubmit:
                raise BackendUnavailable(f"{stage}: {res.error}")
            continue
        if is_cut(res):
            n = res.completions[0].token_ids
            calls.append(call_record(stage, attempt, ids, res, sampling,
                                     CUT_ERROR.format(n=len(n) if n is not None else res.completion_tokens)))
            cuts += 1
            note, last = "", "cut"
            continue
        value, err = parse_json_output(res.text, model_cls)
        calls.append(call_record(stage, attempt, ids, res, sampling, err))
        if value is not None:
            return StructuredOutcome(value, "ok" if attempt == 1 else "retried", calls)
        note, last = RETRY_NOTE.format(error=err, schema=schema_json(schema)), "failed"
    if transport_errors == max_attempts:
        raise BackendUnavailable(f"{stage}: {calls[-1].error}")
    return StructuredOutcome(None, last, calls)


def schema_json(schema: dict[str, Any]) -> str:
    import json

    return json.dumps(schema, separators=(",", ":"))
