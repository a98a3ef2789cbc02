"""Grammar-constrained rows (requests with a `json_schema`): the schema, compiled by xgrammar, applied
as a token bitmask, so every emitted token keeps the text a prefix of a valid document and a
complete document allows only a stop token.

The grammar only constrains; it never chooses a token. A row cut at `max_tokens` ends with
finish_reason "length" and the cut document, as vLLM returns it; nothing fills the fields left (an
earlier version wrote made-up values such as `"trust": 0`): the caller retries with a larger budget
(`lhd_train/bench/structured_calls.py`). docs/benchmark.md, "Answers, context and decoding"."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Grammar:
    compiled: Any  # xgrammar.CompiledGrammar
