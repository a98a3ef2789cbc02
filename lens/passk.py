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
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from lens.errors import LensError
from lens.model import LensModel, block_outputs
from lens.promptsets import PromptSet, TokenForms, encode_item, token_forms
from lens.readout import BASELINE, PRIMARY, Readout
from lens.stats import ratio_ci

KS = (1, 5, 10, 50)
K_AUC = 1000


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

    def score(self, readout: str) -> int:
        return min(self.ranks[readout].values())


def rank_items(model: LensModel, tokenizer: Any, pset: PromptSet, readouts: Mapping[str, Readout],
               layers: Sequence[int], *, force_bos: bool = True) -> list[ItemRanks]:
    """Ranks of every intermediate of every item, per readout and layer (one forward per item)."""
    rows: list[ItemRanks] = []
    for item in pset.items:
        ids, pos = encode_item(tokenizer, item, pset.name, force_bos=force_bos)
        acts = block_outputs(model, ids[None].to(model.device), layers=list(layers))
        forms = [token_forms(tokenizer, w, pset.name) for w in item.intermediates]
        ranks: list[dict[str, dict[int, int]]] = [{name: {} for name in readouts} for _ in forms]
        with torch.no_grad():
            for layer in layers:
                h = acts[layer][0, pos]
                for name, ro in readouts.items():
                    z = ro.logits(layer, h[None])[0]
                    for f, r in zip(forms, ranks, strict=True):
                        r[name][layer] = min(token_ranks(z, f.ids))
        rows += [ItemRanks(pset.name, item.name, f.word, f, r) for f, r in zip(forms, ranks, strict=True)]
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


def summarise_set(rows: Sequence[ItemRanks], readouts: Sequence[str], layers: Sequence[int], *,
                  n_boot: int = 1000, seed: int = 0) -> dict[str, Any]:
    """passk.json's entry for one set: `n`, per readout `{"1": x, "5": x, "10": x, "50": x}`, plus intervals,
    AUC, per-layer pass@k and the token-form counts beside them."""
    items = list(dict.fromkeys(r.item for r in rows))
    if not items:
        raise LensError("no item to score")
    n = len(items)
    out: dict[str, Any] = {"n": n}
    ci: dict[str, dict[str, list[float] | None]] = {}
    auc: dict[str, dict[str, Any]] = {}
    by_layer: dict[str, dict[str, dict[str, float]]] = {}
    per_item_auc: dict[str, np.ndarray] = {}
    for name in readouts:
        out[name] = {str(k): float(item_shares(rows, name, k).mean()) for k in KS}
        ci[name] = {str(k): _interval(item_shares(rows, name, k), n_boot, seed) for k in KS}
        a = per_item_auc[name] = item_auc(rows, name)
        auc[name] = {"value": float(a.mean()), "ci": _interval(a, n_boot, seed)}
        by_layer[name] = {str(layer): {str(k): float(item_shares(rows, name, k, layer).mean()) for k in KS}
                          for layer in layers}
    fallbacks = [f"{r.item}:{r.intermediate}" for r in rows if r.forms.fallback]
    out.update(ci=ci, auc=auc, auc_diff=auc_differences(per_item_auc, n_boot, seed), auc_k_max=K_AUC,
               by_layer=by_layer, layers=list(layers), n_intermediates=len(rows),
               token_forms={"n_fallback": len(fallbacks), "fallback": fallbacks,
                            "n_forms_mean": float(np.mean([len(r.forms.ids) for r in rows]))},
               bootstrap={"n_boot": n_boot, "seed": seed, "unit": "item"})
    return out


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
                        "token_ids": r.forms.ids, "forms": r.forms.forms, "fallback": r.forms.fallback})
    return out
