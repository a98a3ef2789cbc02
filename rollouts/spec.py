"""Typed description of one served model (what a config's `models:` entry holds)."""
from __future__ import annotations

from typing import Literal
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict, Field, field_serializer

HIDDEN = "***"  # what a credential is replaced with wherever a URL or an error text is written
MIN_SECRET = 4  # shorter values (`?v=2`) are not hidden inside texts: they would erase ordinary words


def url_secrets(url: str | None) -> list[str]:
    """The credentials a URL carries, as written and percent-decoded: the user and password of
    `user:pass@host` and every query value (`?key=...`: an API may take its key there)."""
    if not url:
        return []
    parts = urlsplit(url)
    found = [parts.username, parts.password]
    found += [v for _, v in parse_qsl(parts.query, keep_blank_values=True)]
    found += [v for _, v in (pair.partition("=")[::2] for pair in parts.query.split("&"))]
    out: set[str] = set()
    for value in found:
        if value:
            out |= {value, unquote(value), quote(unquote(value), safe="")}
    return sorted(out, key=len, reverse=True)


def public_url(url: str | None) -> str | None:
    """The URL without its credentials (user:pass@ dropped, query values hidden): the form that
    configs, manifests and logs record."""
    if not url:
        return url
    parts = urlsplit(url)
    netloc = parts.netloc.rpartition("@")[2]
    query = urlencode([(k, HIDDEN) for k, _ in parse_qsl(parts.query, keep_blank_values=True)], safe="*")
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def redact(text: str, secrets: list[str]) -> str:
    """`text` with every secret (of MIN_SECRET characters or more) replaced by ***, longest first
    (an error a server returns may echo the request's Authorization header or URL)."""
    for secret in sorted({s for s in secrets if len(s) >= MIN_SECRET}, key=len, reverse=True):
        text = text.replace(secret, HIDDEN)
    return text


class ModelSpec(BaseModel):
    """One model behind one backend. Several roles may point at the same spec (shared server)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    backend: Literal["hf", "openai", "vllm", "transformers-serve"] = Field(
        description="hf: in-process transformers; openai: an existing OpenAI-compatible endpoint; "
        "vllm: a managed `vllm serve`; transformers-serve: a managed `transformers serve` (CPU tests)"
    )
    model: str = Field(description="local path or model id")
    revision: str | None = None
    # hf / vllm
    dtype: str = Field("auto", description="auto | float32 | bfloat16 | float16")
    device: str = Field("auto", description="hf: auto | cpu | cuda | cuda:N; vllm: auto | cpu | cuda "
                        "(auto: cuda when a GPU is visible, else cpu)")
    max_batch_size: int = Field(16, ge=1, description="hf only: most sequences decoded together")
    batch_wait_ms: float = Field(5.0, ge=0, description="hf only: wait this long to fill a batch")
    max_model_len: int | None = Field(None, ge=16, description="context budget in tokens")
    trust_remote_code: bool = False
    adapters: dict[str, str] = Field(default_factory=dict, description="name -> LoRA adapter dir")
    # openai-compatible endpoints
    base_url: str | None = None
    api_key_env: str | None = Field(None, description="name of the env variable holding the key")
    max_in_flight: int | None = Field(
        None, ge=1, description="requests in flight at once; default: vllm: the server's --max-num-seqs "
        "in extra_args, otherwise 32")
    timeout_s: float | None = Field(
        None, gt=0, description="seconds one request may take, queue time included; default 3600 for a "
        "managed or local (127.0.0.1/localhost) server, 600 for a remote API")
    max_retries: int = Field(5, ge=0)
    structured_outputs: Literal["auto", "response_format", "vllm", "prompt"] = Field(
        "auto", description="how JSON schemas reach the server (see rollouts/openai_backend.py)"
    )
    tokenizer: str | None = Field(None, description="openai and vllm: tokenizer (local folder or a hub id in "
                                  "HF_HOME) for exact token counts; default: the model's own")
    startup_timeout_s: float = Field(900.0, gt=0, description="managed servers: wait this long for /health")
    # vllm serve
    tensor_parallel_size: int = Field(1, ge=1)
    data_parallel_size: int = Field(1, ge=1)
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    enable_prefix_caching: bool = Field(
        True, description="vllm and hf: reuse the keys/values of a prompt prefix computed by an earlier request")
    prefix_cache_gib: float | None = Field(
        None, ge=0, description="hf only: GiB of keys/values kept for reuse across requests; default: "
        "2 on CPU, a fifth of the free memory on CUDA (an 8B Llama in bf16 needs 128 KiB per token: 8k "
        "tokens per GiB; the tiny test model 0.5 KiB)")
    kv_budget_gib: float | None = Field(
        None, gt=0, description="hf only: GiB one batch's keys/values and prefill may use (rows are "
        "admitted until it is full); default: the free GPU memory after loading less a margin and the "
        "prefix cache, on CPU the available memory (rollouts/hf/memory_plan.py)")
    max_lora_rank: int = Field(
        64, ge=1, description="vllm: --max-lora-rank when an adapter's adapter_config.json cannot be read yet "
        "(otherwise the adapters' own largest r)")
    extra_args: list[str] = Field(default_factory=list, description="vllm: extra CLI args")
    gpus: str | None = Field(
        None, description="vllm: GPU positions within the inherited CUDA_VISIBLE_DEVICES (\"1,2\" = the 2nd and "
        "3rd visible GPU), never absolute ids; default: the first tensor x data parallel GPUs")
    cpu_kv_cache_gib: int = Field(
        4, ge=1, description="vllm on CPU: GiB of memory for the KV cache (VLLM_CPU_KVCACHE_SPACE)")
    vllm_executable: str | None = Field(
        None, description="vllm: the `vllm` command to run; default $LHD_VLLM, then `vllm` on PATH, "
        "then .venv-vllm/bin/vllm in the lhd checkout (`make vllm-env`)")

    @field_serializer("base_url", when_used="json")
    def _public_base_url(self, v: str | None) -> str | None:
        """Written forms (config.resolved.yaml, manifest.json, auditor.json) never hold credentials."""
        return public_url(v)
