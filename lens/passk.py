"""Pass@k on lens-quality prompt sets, as the Jacobian-lens release scores them (science-4 review
§2.4, §2.5 item 1; docs/lens.md, "Lens quality").

Per item: one forward, the residual at the read position (`lens.promptsets.encode_item`) at every
layer of the lens; per readout and layer, the 1-based rank of each token form of an intermediate
in the readout's logits (ties broken by ascending token id, so a rank is never shared); the
intermediate's rank at a layer is its best form's, and its **score** is its best rank over the
layers. Then

    pass@k = mean over items of (share of the item's intermediates whose score <= k)

for k = 1, 5, 10, 50, with a 95 % percentile interval from a bootstrap over items (`lens.stats.ratio_ci`), and
`auc` = the area under pass@k against log k for k in [1, K_AUC], normalised to 1, which for one
intermediate of score r is `max(0, 1 − log r / log K_AUC)`. Every readout is scored over the same
layers (the lens's source layers), so the logit lens is compared on the layers the J-lens reads.

Beside the readouts, `prompt_echo` is a baseline that reads no activation: the prompt's own
distinct tokens up to the read position, most recent first (the read token is rank 1), every other
token last (rank V). What it recovers, a readout can recover by echoing its input (science-5 §3.1).
`split` repeats the scores per intermediate kind (`lens.promptsets.intermediate_kind`), over all
intermediates and over those with no scored form in the prompt.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from lens.errors import LensError
from lens.model import LensModel, block_outputs
from lens.promptsets import WORD, PromptSet, TokenForms, encode_item, forms_in_prompt, intermediate_kind, token_forms
from lens.readout import BASELINE, PRIMARY, Readout
from lens.stats import ratio_ci

KS = (1, 5, 10, 50)
K_AUC = 1000
#: the baseline readout that ranks the prompt's own tokens by recency
PROMPT_ECHO = "prompt_echo"
#: `split` subsets: every intermediate of a kind, or only those with no scored form in the prompt
ALL_KINDS, ANY, ABSENT = "all", "any", "absent"


def token_ranks(z: torch.Tensor, ids: Sequence[int]) -> list[int]:
    """1-based rank of each of `ids` in the logits `z[V]`: tokens scored higher, plus equal ones with a lower id."""
    z = z.float()
    order = torch.arange(z.shape[-1], device=z.device)
    out = []
    for i in ids:
        zi = z[i]
        out.append(int((z > zi).sum()) + int(((z == zi) & (order < i)).sum()) + 1)
    return out


@dataclass
class ItemRanks:
    """One intermediate of one item: its token forms and, per readout, its rank at each layer."""

    set_name: str
    item: str
    intermediate: str
    forms: TokenForms
    ranks: dict[str, dict[int, int]]  # readout -> layer -> best rank over the forms
    kind: str = WORD
    prompt_forms: list[str] = field(default_factory=list)  # the scored forms whose token is in the prompt

    def score(self, readout: str) -> int:
        return min(self.ranks[readout].values())

    @property
    def in_prompt(self) -> bool:
        return bool(self.prompt_forms)


def echo_ranks(prompt_ids: Sequence[int], ids: Sequence[int], vocab: int) -> list[int]:
    """Rank of each of `ids` when the readout is the prompt itself: its distinct tokens, most recent first, then
    every other token at rank `vocab` (the last place)."""
    place = {t: i + 1 for i, t in enumerate(dict.fromkeys(int(t) for t in reversed(prompt_ids)))}
    return [place.get(int(i), vocab) for i in ids]


def rank_items(model: LensModel, tokenizer: Any, pset: PromptSet, readouts: Mapping[str, Readout],
               layers: Sequence[int], *, force_bos: bool = True) -> list[ItemRanks]:
    """Ranks of every intermediate of every item, per readout and layer (one forward per item), and the
    `prompt_echo` baseline's (the same at every layer)."""
    rows: list[ItemRanks] = []
    vocab = len(tokenizer)
    for item in pset.items:
        ids, pos = encode_item(tokenizer, item, pset.name, force_bos=force_bos)
        prompt_ids = ids[: pos + 1].tolist()
        acts = block_outputs(model, ids[None].to(model.device), layers=list(layers))
        forms = [token_forms(tokenizer, w, pset.name) for w in item.intermediates]
        ranks: list[dict[str, dict[int, int]]] = [{name: {} for name in readouts} for _ in forms]
        with torch.no_grad():
            for layer in layers:
                h = acts[layer][0, pos]
                for name, ro in readouts.items():
                    z = ro.logits(layer, h[None])[0]
                    vocab = max(vocab, z.shape[-1])
                    for f, r in zip(forms, ranks, strict=True):
                        r[name][layer] = min(token_ranks(z, f.ids))
        for f, r in zip(forms, ranks, strict=True):
            r[PROMPT_ECHO] = dict.fromkeys(layers, min(echo_ranks(prompt_ids, f.ids, vocab)))
            rows.append(ItemRanks(pset.name, item.name, f.word, f, r, kind=intermediate_kind(f.word, pset.name),
                                  prompt_forms=forms_in_prompt(f, prompt_ids)))
    return rows


def item_shares(rows: Sequence[ItemRanks], readout: str, k: int, layer: int | None = None) -> np.ndarray:
    """Per item (in order of first appearance): the share of its intermediates with score (or rank at `layer`) <= k."""
    hits: dict[str, list[bool]] = {}
    for r in rows:
        rank = r.score(readout) if layer is None else r.ranks[readout][layer]
        hits.setdefault(r.item, []).append(rank <= k)
    return np.asarray([float(np.mean(h)) for h in hits.values()])


def item_auc(rows: Sequence[ItemRanks], readout: str, k_max: int = K_AUC) -> np.ndarray:
    """Per item: the mean over its intermediates of the normalised area under pass@k vs log k."""
    vals: dict[str, list[float]] = {}
    for r in rows:
        vals.setdefault(r.item, []).append(max(0.0, 1.0 - math.log(r.score(readout)) / math.log(k_max)))
    return np.asarray([float(np.mean(v)) for v in vals.values()])


def _interval(per_item: np.ndarray, n_boot: int, seed: int) -> list[float] | None:
    ci = ratio_ci(per_item, n_boot=n_boot, seed=seed)
    return None if ci is None else list(ci)


def _scores(rows: Sequence[ItemRanks], readouts: Sequence[str], n_boot: int, seed: int) -> dict[str, Any]:
    """pass@k, its intervals, AUC and the paired AUC differences of `rows` (items in order of first appearance)."""
    out: dict[str, Any] = {"n": len(dict.fromkeys(r.item for r in rows)), "n_intermediates": len(rows)}
    if not rows:
        return out
    per_item_auc = {name: item_auc(rows, name) for name in readouts}
    out.update(
        passk={name: {str(k): float(item_shares(rows, name, k).mean()) for k in KS} for name in readouts},
        ci={name: {str(k): _interval(item_shares(rows, name, k), n_boot, seed) for k in KS} for name in readouts},
        auc={name: {"value": float(a.mean()), "ci": _interval(a, n_boot, seed)} for name, a in per_item_auc.items()},
        auc_diff=auc_differences(per_item_auc, n_boot, seed))
    return out


def split_by_kind(rows: Sequence[ItemRanks], readouts: Sequence[str], *, n_boot: int = 1000,
                  seed: int = 0) -> list[dict[str, Any]]:
    """passk.json's `split`: per intermediate kind (and `all` kinds when there are several), the scores over
    every intermediate (`prompt: any`) and over those with no scored form in the prompt (`prompt: absent`)."""
    kinds = list(dict.fromkeys(r.kind for r in rows))
    groups = [(k, [r for r in rows if r.kind == k]) for k in kinds]
    if len(kinds) > 1:
        groups.append((ALL_KINDS, list(rows)))
    out = []
    for kind, members in groups:
        for prompt, subset in ((ANY, members), (ABSENT, [r for r in members if not r.in_prompt])):
            out.append({"kind": kind, "prompt": prompt, **_scores(subset, readouts, n_boot, seed)})
    return out


def summarise_set(rows: Sequence[ItemRanks], readouts: Sequence[str], layers: Sequence[int], *,
                  n_boot: int = 1000, seed: int = 0) -> dict[str, Any]:
    """passk.json's entry for one set: `n`, per readout `{"1": x, "5": x, "10": x, "50": x}`, plus intervals,
    AUC, per-layer pass@k, the token-form counts, the intermediates found in the prompt and the split by kind."""
    if not rows:
        raise LensError("no item to score")
    scores = _scores(rows, readouts, n_boot, seed)
    by_layer = {name: {str(layer): {str(k): float(item_shares(rows, name, k, layer).mean()) for k in KS}
                       for layer in layers} for name in readouts}
    fallbacks = [f"{r.item}:{r.intermediate}" for r in rows if r.forms.fallback]
    in_prompt = [r for r in rows if r.in_prompt]
    return {"n": scores["n"], **scores["passk"], "ci": scores["ci"], "auc": scores["auc"],
            "auc_diff": scores["auc_diff"], "auc_k_max": K_AUC, "by_layer": by_layer, "layers": list(layers),
            "n_intermediates": len(rows),
            "token_forms": {"n_fallback": len(fallbacks), "fallback": fallbacks,
                            "n_forms_mean": float(np.mean([len(r.forms.ids) for r in rows]))},
            "in_prompt": {"n": len(in_prompt),
                          "by_kind": {k: [sum(r.in_prompt for r in rows if r.kind == k),
                                          sum(r.kind == k for r in rows)] for k in dict.fromkeys(r.kind for r in rows)},
                          "intermediates": [f"{r.item}:{r.intermediate}" for r in in_prompt]},
            "split": split_by_kind(rows, readouts, n_boot=n_boot, seed=seed),
            "bootstrap": {"n_boot": n_boot, "seed": seed, "unit": "item"}}


def auc_differences(per_item_auc: Mapping[str, np.ndarray], n_boot: int, seed: int) -> dict[str, dict[str, Any]]:
    """`"<readout> - <reference>"`: the AUC difference paired by item (`item_auc`, same item order for
    every readout), with its bootstrap interval, for every readout against the logit lens and every
    further readout against the J-lens. Two AUCs whose own intervals overlap can still differ: the
    items are shared, so the pairing removes how hard each item is from the comparison."""
    out: dict[str, dict[str, Any]] = {}
    for ref in (BASELINE, PRIMARY):
        if ref not in per_item_auc:
            continue
        for name, a in per_item_auc.items():
            if name in (ref, BASELINE):
                continue
            d = a - per_item_auc[ref]
            out[f"{name} - {ref}"] = {"value": float(d.mean()), "ci": _interval(d, n_boot, seed)}
    return out


def rank_rows_json(rows: Sequence[ItemRanks]) -> list[dict[str, Any]]:
    """One JSON row per (item, intermediate, readout): the ranks by layer and the score (passk_ranks.jsonl)."""
    out = []
    for r in rows:
        for name, by_layer in r.ranks.items():
            out.append({"set": r.set_name, "item": r.item, "intermediate": r.intermediate, "readout": name,
                        "ranks": {str(k): v for k, v in by_layer.items()}, "score": r.score(name),
                        "token_ids": r.forms.ids, "forms": r.forms.forms, "fallback": r.forms.fallback,
                        "kind": r.kind, "in_prompt": r.in_prompt, "prompt_forms": r.prompt_forms})
    return out
