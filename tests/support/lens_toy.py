"""Small models for tests and benchmarks (no downloads).

- `ToyResidualModel`: a `LensModel` whose blocks are `h <- h + scale·W_l h` applied to every
  position independently, with a LayerNorm and a linear head. Its Jacobian lens is known in
  closed form: `J_l = prod_{m=l+1..target} (I + scale·W_m)` (docs/lens-background.md §4, T2).
- `ByteTokenizer`: bytes + 1, BOS = 0.
- `build_lens_tiny`: the project's tiny-model builder (`lhd_train.tiny_model`) with a chat
  template imitating the family (Llama 3 or Qwen) and the lens vocabulary as single tokens.
"""
from __future__ import annotations

from collections.abc import Sequence
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
# tiny Hugging Face models for the lens tests: `lhd_train.tiny_model` with the lens vocabulary
# ---------------------------------------------------------------------------------------------

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


def lens_corpus() -> list[str]:
    """The project's tokenizer corpus plus the lens vocabulary, repeated so each word is one token."""
    from lhd_train.tiny_model import builtin_corpus

    lines = [_FILLER] * 20
    for w in _TOKENIZER_WORDS:
        for form in (w, w.capitalize()):
            lines += [f"{form} {form} {form}", f"the claim is {form}.", f"Verdict: {form}"] * 6
    lines += [f"row {i}, {i * 7 % 97}, {i * 3}.{i % 10}" for i in range(200)]
    return builtin_corpus() + lines


#: the lens tests' two families: a Llama with a Llama-3-style template and a Qwen3 with a Qwen-style one
LENS_CHAT_STYLE = {"llama": "llama3", "qwen2": "qwen", "qwen3": "qwen"}


def build_lens_tiny(arch: str, out_dir: str | Path, *, seed: int = 0, hidden_size: int = 64, num_layers: int = 2,
                    corpus: list[str] | None = None) -> Path:
    """A random tiny `arch` model with its family's template style and untied embeddings."""
    from lhd_train.tiny_model import build_tiny_model

    return build_tiny_model(arch, out_dir, seed=seed, hidden_size=hidden_size, num_layers=num_layers,  # type: ignore[arg-type]
                            corpus=corpus if corpus is not None else lens_corpus(),
                            chat_style=LENS_CHAT_STYLE[arch], tie_word_embeddings=False)  # type: ignore[arg-type]
