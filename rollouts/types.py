"""Request/result types shared by every generation backend.

Backends know nothing about deception: they take chat messages plus sampling parameters
(and optionally a JSON schema) and return text with token and latency accounting.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

Message = dict[str, str]  # {"role": "system"|"user"|"assistant", "content": str}


@dataclass(frozen=True)
class SamplingParams:
    """Decoding settings; recorded verbatim in every trajectory row."""

    temperature: float = 0.7
    top_p: float = 1.0
    max_tokens: int = 512
    seed: int | None = None
    n: int = 1

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class GenerationRequest:
    messages: list[Message]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    json_schema: dict[str, Any] | None = None  # constrain output to this JSON schema
    adapter: str | None = None  # LoRA adapter name/path, when the backend serves adapters
    request_id: str | None = None


@dataclass
class Completion:
    text: str
    token_ids: list[int] | None = None
    finish_reason: str = "stop"  # "stop" | "length" | "error"


@dataclass
class GenerationResult:
    completions: list[Completion]
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    latency_s: float = 0.0
    model_id: str = ""
    error: str | None = None  # set when the request failed after the backend's own retries
    prompt_token_ids: list[int] | None = None
    # The messages actually sent, when the backend had to change them (schema written into the
    # prompt for servers without structured outputs); None means exactly the request's messages.
    sent_messages: list[Message] | None = None

    @property
    def text(self) -> str:
        return self.completions[0].text if self.completions else ""

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.completions)
