"""Request/result types shared by every generation backend.

Backends know nothing about deception: they take chat messages plus sampling parameters
(and optionally a JSON schema) and return text with token and latency accounting.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

Message = dict[str, str]  # {"role": "system"|"user"|"assistant", "content": str}


#: What a decoding field means when neither the request nor the model's generation config sets
#: it: vLLM's neutral values (its `_DEFAULT_SAMPLING_PARAMS`), so `hf` and `vllm` agree.
NEUTRAL_SAMPLING: dict[str, Any] = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0}
#: The decoding fields a model's generation_config.json may set and every backend honours.
MODEL_DEFAULT_FIELDS = tuple(NEUTRAL_SAMPLING)


@dataclass(frozen=True)
class SamplingParams:
    """Decoding settings; recorded verbatim in every trajectory row. A decoding field left None
    means "the model's own default" (its generation_config.json, as vLLM applies it), else the
    neutral value (`NEUTRAL_SAMPLING`); `top_k` 0 means no top-k cut."""

    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int = 512
    seed: int | None = None
    n: int = 1
    top_k: int | None = None
    repetition_penalty: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def resolved(self, model_defaults: dict[str, Any] | None) -> ResolvedSampling:
        """Every decoding field set: this request's value, else the model's default, else neutral."""
        defaults = model_defaults or {}

        def fallback(name: str) -> Any:
            value = defaults.get(name)
            return NEUTRAL_SAMPLING[name] if value is None else value

        return ResolvedSampling(
            temperature=float(fallback("temperature")) if self.temperature is None else self.temperature,
            top_p=float(fallback("top_p")) if self.top_p is None else self.top_p,
            max_tokens=self.max_tokens,
            seed=self.seed,
            n=self.n,
            top_k=int(fallback("top_k")) if self.top_k is None else self.top_k,
            repetition_penalty=(float(fallback("repetition_penalty")) if self.repetition_penalty is None
                                else self.repetition_penalty),
        )


@dataclass(frozen=True)
class ResolvedSampling:
    """`SamplingParams` with every decoding field set (`SamplingParams.resolved`): what a row
    decodes with. Same fields, same order, so `to_dict` records the same keys."""

    temperature: float
    top_p: float
    max_tokens: int
    seed: int | None
    n: int
    top_k: int
    repetition_penalty: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def effective_sampling(sampling: SamplingParams, model_defaults: dict[str, Any] | None) -> dict[str, Any]:
    """What a role decodes with, for the manifest and the report: `sampling` resolved against the
    model's defaults (a backend's `describe()["generation_defaults"]`); when those are unknown
    (None: a remote API) an unset field stays None, "the provider's default"."""
    if model_defaults is None:
        return sampling.to_dict()
    return sampling.resolved(model_defaults).to_dict()


def generation_defaults(config: Any) -> dict[str, Any]:
    """The decoding fields a model's generation config sets (a transformers `GenerationConfig`
    or the dict of a generation_config.json); unset ones are left out."""
    def get(name: str) -> Any:
        return config.get(name) if isinstance(config, dict) else getattr(config, name, None)

    return {k: get(k) for k in MODEL_DEFAULT_FIELDS if get(k) is not None}


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
    # The decoding settings used: `hf` resolves unset fields to the model's defaults; a server
    # backend gives the fields it sent (an unset field stays None: the server's default).
    sampling: dict[str, Any] | None = None
    # False when sending the same request again cannot help (a managed server that is alive did
    # not answer within the timeout: it already dropped the work); callers then stop retrying.
    resubmit: bool = True

    @property
    def text(self) -> str:
        return self.completions[0].text if self.completions else ""

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.completions)


_SURROGATE = re.compile("[\ud800-\udfff]")  # in a Python str every surrogate is a lone one


def sendable(text: str) -> str:
    """`text` with each lone UTF-16 surrogate replaced by U+FFFD: a model answer may hold one (stored
    exactly in the rows), but a request body and a tokenizer need valid UTF-8."""
    return _SURROGATE.sub("\ufffd", text)
