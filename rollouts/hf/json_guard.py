"""Grammar-constrained rows (requests with a `json_schema`): the schema is compiled by xgrammar
with `any_whitespace=False` and applied as a token bitmask (special tokens other than the stop
tokens are masked too), so every token a row emits keeps its text a prefix of a valid document,
and once the document is complete only a stop token is allowed.

The grammar only constrains; it never chooses a token for the model. A row that reaches its
`max_tokens` before its document is complete ends with finish_reason "length" and its text is
the cut document, exactly as vLLM returns it. Nothing closes the open string or fills the fields
left (an earlier version did, and wrote made-up values such as `"trust": 0`); the caller sees
the cut and decides (`lhd_train/bench/structured_calls.py`: recorded as cut, retried with a
larger budget). `stats["json_cut_rows"]` counts those rows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Grammar:
    compiled: Any  # xgrammar.CompiledGrammar
