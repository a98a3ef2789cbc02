"""Entitlement token sets and margins (docs/lens-background.md §6).

Token sets S (supported), N (not entitled), R (refuted) are frozen word lists, each word kept in
those of its surface forms that are one token; a token in two sets is removed from both, and an
empty S or N fails naming `--token-sets FILE` and the first-token fallback. Margins on readout
logits over S ∪ N ∪ R: `m_E = LSE_S − LSE_N`, `m_R`, `m_P` and the set-size corrected `m_E_size`.
docs/lens.md, "Token sets and margins"."""
from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from lens.errors import LensError

log = logging.getLogger(__name__)

SUPPORTED_WORDS = ["supported", "supports", "confirmed", "confirms", "verified", "documented", "stated", "shows",
                   "evidence", "true", "yes", "correct"]
NOT_ENTITLED_WORDS = ["unsupported", "unverified", "unstated", "unknown", "unclear", "uncertain", "missing", "absent",
                      "insufficient", "speculation", "assumption", "cannot"]
REFUTED_WORDS = ["refuted", "contradicts", "contradicted", "false", "incorrect", "wrong", "inconsistent", "disproved"]
#: frozen Chinese forms, added for Qwen families (kept only where single tokens)
CHINESE = {"S": ["支持", "证实"], "N": ["未知", "不确定", "无法"], "R": ["错误", "矛盾", "否认"]}

SET_NAMES = ("S", "N", "R")


@dataclass
class TokenSets:
    S: list[int]
    N: list[int]
    R: list[int]
    forms: dict[str, list[str]] = field(default_factory=dict)  # set -> kept surface forms
    dropped: list[str] = field(default_factory=list)
    mode: str = "single-token"

    def union(self) -> list[int]:
        seen: dict[int, None] = {}
        for name in SET_NAMES:
            for t in getattr(self, name):
                seen.setdefault(t, None)
        return list(seen)

    def index_sets(self, within: Sequence[int] | None = None) -> dict[str, list[int]]:
        """Positions of each set inside `within` (default `union()`), for logits computed on those token ids
        only; a variant's sets (`without`) index into the full sets' union."""
        pos = {t: i for i, t in enumerate(self.union() if within is None else within)}
        return {name: [pos[t] for t in getattr(self, name)] for name in SET_NAMES}

    def without(self, token_ids: Sequence[int], why: str) -> TokenSets:
        """A variant of the sets with `token_ids` left out of every set: read where those tokens are the
        answer to a question (after a Yes/No elicitation "yes" is the answer, not a word of entitlement, so
        an S set holding it would measure the stated answer again). The removed forms are listed in
        `dropped` with `why`."""
        gone = set(token_ids)
        removed = [f"{name}:#{t}({why})" for name in SET_NAMES for t in getattr(self, name) if t in gone]
        return TokenSets(S=[t for t in self.S if t not in gone], N=[t for t in self.N if t not in gone],
                         R=[t for t in self.R if t not in gone], forms=self.forms, dropped=self.dropped + removed,
                         mode=self.mode)

    def to_json(self) -> dict:
        return asdict(self)


def default_words(model_type: str | None = None) -> dict[str, list[str]]:
    words = {"S": list(SUPPORTED_WORDS), "N": list(NOT_ENTITLED_WORDS), "R": list(REFUTED_WORDS)}
    if model_type and model_type.lower().startswith("qwen"):
        for k, extra in CHINESE.items():
            words[k] += extra
    return words


def surface_forms(word: str) -> list[str]:
    """as given, lower-case, Capitalised; each bare and with a leading space (no duplicates)."""
    bases = [word, word.lower(), word[:1].upper() + word[1:]]
    return list(dict.fromkeys(f for b in bases for f in (b, " " + b)))


def resolve_forms(tokenizer: Any, words: Mapping[str, Sequence[str | int]], fallback: str = "strict"
                  ) -> tuple[dict[str, list[int]], dict[str, list[str]], list[str]]:
    """Per named set, the token ids of its words' single-token forms (`surface_forms`; the first token of a longer
    form with `fallback="first-token"`; an int entry is a token id as it is), the forms kept, and what was
    dropped; a token in two sets says nothing about either and is removed from both."""
    if fallback not in ("strict", "first-token"):
        raise LensError(f"unknown token fallback {fallback!r} (allowed: strict, first-token)")
    ids: dict[str, list[int]] = {k: [] for k in words}
    kept: dict[str, list[str]] = {k: [] for k in words}
    dropped: list[str] = []
    vocab_size = len(tokenizer) if hasattr(tokenizer, "__len__") else None
    for name, entries in words.items():
        for entry in entries:
            if isinstance(entry, int):
                if vocab_size is not None and not 0 <= entry < vocab_size:
                    raise LensError(f"token id {entry} in set {name} is outside the vocabulary ({vocab_size})")
                ids[name].append(entry)
                kept[name].append(f"#{entry}")
                continue
            for form in surface_forms(str(entry)):
                toks = tokenizer(form, add_special_tokens=False)["input_ids"]
                if len(toks) == 1 or (fallback == "first-token" and len(toks) > 1):
                    if toks[0] not in ids[name]:
                        ids[name].append(int(toks[0]))
                        kept[name].append(form if len(toks) == 1 else f"{form}[0]")
                else:
                    dropped.append(f"{name}:{form!r}({len(toks)} tokens)")
    names = list(words)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            shared = set(ids[a]) & set(ids[b])
            if shared:
                dropped += [f"{a}&{b}:#{t}" for t in sorted(shared)]
                ids[a] = [t for t in ids[a] if t not in shared]
                ids[b] = [t for t in ids[b] if t not in shared]
    return ids, kept, dropped


def resolve_token_sets(
    tokenizer: Any,
    words: Mapping[str, Sequence[str | int]] | None = None,
    *,
    model_type: str | None = None,
    fallback: str = "strict",
) -> TokenSets:
    """Resolve word lists to token ids (`resolve_forms`). `fallback="first-token"` keeps the first token of
    multi-token forms. Entries that are ints are taken as token ids as they are (for user-supplied sets)."""
    words = dict(words or default_words(model_type))
    unknown = set(words) - set(SET_NAMES)
    if unknown:
        raise LensError(f"token sets must be named S, N, R; got {sorted(unknown)}")
    ids, kept, dropped = resolve_forms(tokenizer, {k: words.get(k, []) for k in SET_NAMES}, fallback)
    if dropped:
        log.info("token sets: dropped %d forms that are not single tokens or are shared: %s", len(dropped),
                 ", ".join(dropped[:40]) + (" ..." if len(dropped) > 40 else ""))
    empty = [n for n in ("S", "N") if not ids[n]]
    if empty:
        raise LensError(
            f"token set(s) {', '.join(empty)} are empty for this tokenizer: none of their word forms is a single "
            "token. Pass your own sets with --token-sets FILE (JSON {\"S\": [...], \"N\": [...], \"R\": [...]}, "
            "words or token ids) or use --token-fallback first-token"
        )
    if not ids["R"]:
        log.warning("token set R is empty for this tokenizer: m_R and m_P will be NaN")
    return TokenSets(S=ids["S"], N=ids["N"], R=ids["R"], forms=kept, dropped=dropped,
                     mode="single-token" if fallback == "strict" else "first-token")


def load_token_sets_file(path: str | Path) -> dict[str, list]:
    try:
        obj = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise LensError(f"{path}: cannot read token sets ({exc})") from exc
    if not isinstance(obj, dict) or not all(isinstance(obj.get(k, []), list) for k in SET_NAMES):
        raise LensError(f"{path}: expected {{\"S\": [...], \"N\": [...], \"R\": [...]}}")
    return {k: obj.get(k, []) for k in SET_NAMES}


def _lse(z: torch.Tensor, idx: Sequence[int]) -> torch.Tensor:
    if not idx:
        return torch.full(z.shape[:-1], float("nan"), dtype=z.dtype, device=z.device)
    return torch.logsumexp(z[..., list(idx)], dim=-1)


def margins(z: torch.Tensor, sets: Mapping[str, Sequence[int]]) -> dict[str, torch.Tensor]:
    """Margins from logits `z[..., K]`; `sets` maps S/N/R to column indices of `z`."""
    z = z.float()
    S, N, R = _lse(z, sets["S"]), _lse(z, sets["N"]), _lse(z, sets.get("R", []))
    nS, nN = max(len(sets["S"]), 1), max(len(sets["N"]), 1)
    return {
        "m_E": S - N,
        "m_R": R - torch.maximum(S, N),
        "m_P": S - R,
        "m_E_size": (S - math.log(nS)) - (N - math.log(nN)),
    }


MARGIN_NAMES = ("m_E", "m_R", "m_P", "m_E_size")
