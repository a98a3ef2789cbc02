"""The unit of work: a request (`Pending`) expands into `n` rows (`Row`), one per completion. The
queue holds rows, the decode loop batches them, the sampler fills their tokens, and the request
is resolved when all of its rows are done."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from rollouts.hf.json_guard import Grammar
from rollouts.types import Completion, GenerationRequest, GenerationResult


@dataclass
class Pending:
    request: GenerationRequest
    future: asyncio.Future[GenerationResult]
    t0: float
    prompt_ids: list[int]
    completions: list[Completion | None]
    remaining: int
    cached_tokens: int = 0  # prompt tokens whose keys/values came from the prefix cache
    sampling: dict[str, Any] | None = None  # the settings used (unset fields resolved), for the result


@dataclass
class Row:
    pending: Pending
    j: int
    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    grammar: Grammar | None
    adapter: str | None
    top_k: int = 0  # 0: no top-k cut
    repetition_penalty: float = 1.0  # 1: none
    # decode state (reset at the start of every batch run)
    tokens: list[int] = field(default_factory=list)
    finish: str | None = None
    matcher: Any = None
    seen: set[int] | None = None  # token ids the repetition penalty applies to (None: no penalty)
    generator: Any = None
    error: str | None = None  # set when this row alone ran out of memory (decode.decode_rows)

