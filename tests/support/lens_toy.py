"""Small models for tests and benchmarks (no downloads).

- `ToyResidualModel`: a `LensModel` whose blocks are `h <- h + scale·W_l h` applied to every
  position independently, with a LayerNorm and a linear head. Its Jacobian lens is known in
  closed form: `J_l = prod_{m=l+1..target} (I + scale·W_m)` (docs/lens-background.md §4, T2).
- `ByteTokenizer`: bytes + 1, BOS = 0.
- `build_tiny_hf`: a random tiny Llama / Qwen2 / Qwen3 with a locally trained byte-level BPE
  tokenizer and a chat template imitating Llama 3 (header tokens, `| trim`, a default system
  block) or Qwen (ChatML, default system prompt, optional empty think block), saved to a dir.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn


class ByteTokenizer:
    bos_token_id = 0
    eos_token_id = None
    chat_template = None

    def __call__(self, text: str, add_special_tokens: bool = True, **_: Any) -> dict:
        ids = [b + 1 for b in text.encode("utf-8")]
        return {"input_ids": ([0] if add_special_tokens else []) + ids}

    def __len__(self) -> int:
        return 257


class _Linear(nn.Module):
    def __init__(self, d: int, scale: float):
        super().__init__()
        self.W = nn.Parameter(torch.randn(d, d) / d**0.5)
        self.scale = scale

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.scale * h @ self.W.T


class ToyResidualModel(nn.Module):
    """Per-position linear residual blocks; implements `lens.model.LensModel`."""

    def __init__(self, d: int = 8, n_layers: int = 4, vocab: int = 257, scale: float = 0.1, seed: int = 0):
        super().__init__()
        g = torch.random.fork_rng()
        with g:
            torch.manual_seed(seed)
            self.embed = nn.Embedding(vocab, d)
            self._blocks = nn.ModuleList([_Linear(d, scale) for _ in range(n_layers)])
            self.norm = nn.LayerNorm(d)
            self.head = nn.Linear(d, vocab, bias=False)
        self.eval()
        for p in self.parameters():
            p.requires_grad_(False)
        self.name = f"toy-d{d}-L{n_layers}"
        self.n_layers = n_layers
        self.d_model = d
        self.revision = None

    @property
    def blocks(self) -> Sequence[nn.Module]:
        return self._blocks

    @property
    def device(self) -> torch.device:
        return self.head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.head.weight.dtype

    def forward_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        for block in self._blocks:
            h = block(h)
        return self.head(self.norm(h))

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(h)

    def unembed(self, h: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        x = self.norm(h)
        return self.head(x) if token_ids is None else x @ self.head.weight[token_ids].T

    def exact_jacobian(self, source: int, target: int) -> torch.Tensor:
        J = torch.eye(self.d_model)
        for m in range(source + 1, target + 1):
            blk = self._blocks[m]
            J = (torch.eye(self.d_model) + blk.scale * blk.W) @ J
        return J


# ---------------------------------------------------------------------------------------------
# tiny Hugging Face models with a local tokenizer
# ---------------------------------------------------------------------------------------------

SPECIAL_TOKENS = [
    "<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>",
    "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
]

#: imitates Llama 3.x: BOS from the template, header tokens, trimmed content, a default system block
LLAMA3_STYLE_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}{%- set sys = messages[0]['content'] | trim %}"
    "{%- set rest = messages[1:] %}"
    "{%- else %}{%- set sys = '' %}{%- set rest = messages %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{{- 'Cutting Knowledge Date: December 2023\\nToday Date: 26 Jul 2024\\n\\n' }}"
    "{{- sys + '<|eot_id|>' }}"
    "{%- for m in rest %}"
    "{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

#: imitates Qwen2.5 / Qwen3 ChatML: a default system prompt, `<|im_start|>role\n...<|im_end|>\n`,
#: and (like Qwen3 with thinking off) an empty think block after the generation prompt
QWEN_STYLE_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{%- if think_block is defined and think_block %}{{ '<think>\n\n</think>\n\n' }}{%- endif %}{%- endif %}"
)

#: words the tiny tokenizer must hold as single tokens (entitlement sets and the probe layout)
_TOKENIZER_WORDS = (
    "supported supports confirmed confirms verified documented stated shows evidence true yes correct "
    "unsupported unverified unstated unknown unclear uncertain missing absent insufficient speculation "
    "assumption cannot refuted contradicts contradicted false incorrect wrong inconsistent disproved"
).split()

_FILLER = (
    "You check reports against the provided files. Use only the files. Claim: Question: Do the files support "
    "this claim? Verdict: According to the file the revenue of the product is 12. The price for Alpha is 3.5 "
    "and the churn rate of Beta was 40 percent. The team reports growth in the market. Manager feedback response: "
    "please revise the report with citations from the data. region units price cost margin customers headcount."
)


def tiny_tokenizer_corpus(extra: Iterable[str] = ()) -> list[str]:
    lines = [_FILLER] * 20
    for w in _TOKENIZER_WORDS:
        for form in (w, w.capitalize()):
            lines += [f"{form} {form} {form}", f"the claim is {form}.", f"Verdict: {form}"] * 6
    lines += list(extra)
    lines += [f"row {i}, {i * 7 % 97}, {i * 3}.{i % 10}" for i in range(200)]
    return lines


def train_tiny_tokenizer(vocab_size: int = 2000, extra: Iterable[str] = ()):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE(unk_token=None))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(tiny_tokenizer_corpus(extra), trainer)
    return bpe


def build_tiny_hf(
    arch: str,
    out_dir: str | Path,
    *,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    vocab_size: int = 2000,
    bpe: Any = None,
) -> Path:
    """Save a random tiny `llama` / `qwen2` / `qwen3` causal LM plus tokenizer + chat template into `out_dir`."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedTokenizerFast,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    bpe = bpe or train_tiny_tokenizer(vocab_size)
    if arch == "llama":
        tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                                      pad_token="<|pad|>", chat_template=LLAMA3_STYLE_TEMPLATE)
    elif arch in ("qwen2", "qwen3"):
        tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=None, eos_token="<|im_end|>",
                                      pad_token="<|pad|>", chat_template=QWEN_STYLE_TEMPLATE)
    else:
        raise ValueError(f"unknown arch {arch!r} (allowed: llama, qwen2, qwen3)")
    common = dict(vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                  num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=4096, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                  bos_token_id=tok.bos_token_id)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        if arch == "llama":
            model = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=False))
        elif arch == "qwen2":
            model = Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=True))
        else:
            model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=hidden_size // 4, tie_word_embeddings=False))
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
