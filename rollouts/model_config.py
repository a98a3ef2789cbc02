"""The one reader of a model's `config.json`: its shape (what memory and FLOPs depend on) and its
context window, for every caller (the hf backend's memory plan, vLLM's KV-cache estimate and CPU
flags, the run config's window check, the lens fit plan).

transformers' own `AutoConfig` reads the file, so its defaults apply (grouped-query heads, an
explicit `head_dim`, `n_positions` as GPT-2 calls the window) and a multimodal config is read
through `get_text_config()`. A config whose `model_type` transformers does not know is read as a
plain `PretrainedConfig` (its keys as written). Never downloads: a hub id must be in HF_HOME."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

from rollouts.backend import BackendError

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from rollouts.spec import BackendSpec

# Where a text config states its context window, in order (AutoConfig maps GPT-2's n_positions).
WINDOW_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def _positive(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def as_config(config: Mapping[str, Any] | PretrainedConfig) -> PretrainedConfig:
    """A transformers config from a `config.json` mapping (or the config itself)."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(config, PretrainedConfig):
        return config
    data = dict(config)
    try:
        return AutoConfig.for_model(**data) if data.get("model_type") else PretrainedConfig(**data)
    except (ValueError, TypeError, KeyError):  # a model_type transformers does not know
        return PretrainedConfig(**{k: v for k, v in data.items() if k != "model_type"})


def text_config(config: Mapping[str, Any] | PretrainedConfig) -> Any:
    """The text model's config (the config itself for a text-only model)."""
    from transformers import PretrainedConfig

    text = as_config(config).get_text_config()
    if isinstance(getattr(text, "text_config", None), Mapping):  # an unknown multimodal model_type
        text = as_config(text.text_config)
    return text if isinstance(text, PretrainedConfig) else as_config(text)


def read_config(name: str | Path, revision: str | None = None, *,
                trust_remote_code: bool = False) -> PretrainedConfig:
    """The config of a local model folder or of a hub id already in HF_HOME; a BackendError naming
    the model when there is none or it does not read."""
    from transformers import AutoConfig, PretrainedConfig

    where: dict[str, Any] = {"revision": revision, "local_files_only": True}
    try:
        try:
            config: PretrainedConfig = AutoConfig.from_pretrained(str(name), trust_remote_code=trust_remote_code,
                                                                   **where)
        except ValueError:  # no or an unknown model_type: the keys as written
            config = PretrainedConfig.from_pretrained(str(name), **where)
    except Exception as e:  # noqa: BLE001 - OSError, ValueError, HFValidationError, JSONDecodeError ...
        raise BackendError(f"model {name}: no readable config.json (a local folder, or a hub id in HF_HOME): "
                           f"{' '.join(str(e).split())[:200]}") from None
    return config


def context_window(config: Mapping[str, Any] | PretrainedConfig) -> tuple[int, str] | None:
    """(tokens, the key it was read from) of the text model's context window; None when the config
    does not say."""
    text = text_config(config)
    for key in WINDOW_KEYS:
        found = _positive(getattr(text, key, None))
        if found is not None:
            return found, key
    return None


def model_window(spec: BackendSpec) -> tuple[int, str] | None:
    """(tokens, where it was read) of a model entry's context window when known without loading
    it: its `max_model_len`, else the config.json of a local folder. None when neither says (a
    hub id; a torn config.json is named when the model loads)."""
    if spec.max_model_len is not None:
        return spec.max_model_len, "max_model_len"
    folder = Path(spec.model).expanduser()
    if not (folder / "config.json").is_file():
        return None
    try:
        found = context_window(read_config(folder))
    except BackendError:
        return None
    return None if found is None else (found[0], f"{folder / 'config.json'} {found[1]}")


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only model that its memory and FLOPs depend on."""

    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool = False
    qk_norm: bool = False  # Qwen3 normalises queries and keys per head
    qkv_bias: bool = False  # Qwen2
    model_type: str = ""
    experts: int = 0  # mixture-of-experts: routed experts per layer (0: dense)
    context: int | None = None  # the context window, when the config states it

    @classmethod
    def parse(cls, config: Mapping[str, Any] | PretrainedConfig, source: str = "config.json") -> Self:
        """From a transformers config or a `config.json` mapping (a multimodal one: its text model)."""
        text = text_config(config)

        def need(key: str) -> int:
            value = _positive(getattr(text, key, None))
            if value is None:
                raise BackendError(f"{source}: field '{key}' is {getattr(text, key, None)!r}; the model's shape "
                                   "needs a positive integer")
            return value

        d, heads = need("hidden_size"), need("num_attention_heads")
        model_type = str(getattr(text, "model_type", "") or "")
        tied = getattr(text, "tie_word_embeddings", None)
        if tied is None:
            tied = getattr(as_config(config), "tie_word_embeddings", False)
        return cls(d_model=d, n_layers=need("num_hidden_layers"), n_heads=heads,
                   n_kv_heads=_positive(getattr(text, "num_key_value_heads", None)) or heads,
                   head_dim=_positive(getattr(text, "head_dim", None)) or d // heads,
                   ffn=_positive(getattr(text, "intermediate_size", None)) or 4 * d,
                   vocab=_positive(getattr(text, "vocab_size", None)) or 0, tied=bool(tied),
                   qk_norm=model_type.startswith("qwen3"), qkv_bias=model_type == "qwen2", model_type=model_type,
                   experts=max([_positive(getattr(text, k, None)) or 0 for k in EXPERT_KEYS]),
                   context=(context_window(text) or (None, ""))[0])

    @property
    def block_params(self) -> int:
        """Parameters of one block: q/k/v/o (with Qwen2's biases), the gated MLP, the norms."""
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        attn = self.d_model * (q + 2 * kv) + q * self.d_model + ((q + 2 * kv) if self.qkv_bias else 0)
        norms = 2 * self.d_model + (2 * self.head_dim if self.qk_norm else 0)
        return attn + 3 * self.d_model * self.ffn + norms

    @property
    def n_params(self) -> int:
        """Parameters of the dense model: embeddings (twice when untied), the blocks, the final norm."""
        embed = self.vocab * self.d_model * (1 if self.tied else 2)
        return embed + self.n_layers * self.block_params + self.d_model

    def kv_bytes_per_token(self, dtype_bytes: int, tensor_parallel: int = 1) -> int:
        """Keys and values of one token in every layer, on one of `tensor_parallel` GPUs (KV heads
        are split over them, and replicated when there are more GPUs than KV heads)."""
        heads = max(1, -(-self.n_kv_heads // tensor_parallel))
        return 2 * self.n_layers * heads * self.head_dim * dtype_bytes

    def prefill_bytes_per_token(self, dtype_bytes: int) -> int:
        """Transient tensors of one layer's forward per prompt token (an estimate: the MLP's gate,
        up and product, and ~6 hidden-sized tensors: residual, norm, q/k/v, attention output).
        Layers run one after another, so only one layer's activations are alive at a time."""
        return (3 * self.ffn + 6 * self.d_model) * dtype_bytes

    def describe(self) -> str:
        return (f"{self.model_type or 'decoder'}: d {self.d_model}, {self.n_layers} blocks, {self.n_heads} heads / "
                f"{self.n_kv_heads} kv, ffn {self.ffn}, vocab {self.vocab}, {self.n_params / 1e9:.2f}B parameters")
