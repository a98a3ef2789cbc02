"""Causal check of lens directions: does removing what the lens reads change what the model says?
(science-4 review §2.4 item 2, §2.5 item 2).

A token's lens logit at layer `l` is `<v, h> / rms(J_l h)` with `v = J_lᵀ (g ⊙ w_tok)` (the
readout's `direction`). At the read position and a chosen layer the residual is edited (each
readout's direction projected out, the entitlement contrast projected out, and norm-matched random
edits `h − |h·v̂| û` as controls) and the model runs on; measured: output KL, top-1 change and the
answer's rank. All edits of one item and layer run as one batch (row 0 unedited). docs/lens.md, "Causal check"."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from lens.calibration import kl_rows
from lens.directions import token_directions
from lens.errors import LensError
from lens.margins import TokenSets
from lens.model import block_outputs, capture, run
from lens.passk import token_ranks
from lens.promptsets import PromptSet, encode_item, token_forms
from lens.readout import BASELINE, PRIMARY, Readout
from lens.stats import ratio_ci

ENTITLEMENT, RANDOM = "entitlement", "random:"


def unit(v: torch.Tensor) -> torch.Tensor:
    n = v.norm()
    if not torch.isfinite(n) or n == 0:
        raise LensError("a lens direction is zero (a token row or lens matrix of zeros?)")
    return v / n


@dataclass
class CausalConfig:
    layers: list[int]
    n_random: int = 3
    seed: int = 0
    force_bos: bool = True


def item_edits(model: Any, readouts: Mapping[str, Readout], layer: int, h: torch.Tensor,
               intermediates: Sequence[Sequence[int]], token_sets: TokenSets | None, gen: torch.Generator,
               n_random: int) -> list[dict[str, Any]]:
    """The edits of one item at one layer: `{kind, intermediate index or None, delta}` with `h' = h − delta`."""
    for name, ro in readouts.items():
        if not ro.has_layer(layer):
            raise LensError(f"causal layer {layer}: the {name} readout cannot read it (a lens fitted on other layers)")
    dirs: list[tuple[str, int | None, torch.Tensor]] = []
    for i, ids in enumerate(intermediates):
        u = token_directions(model, ids).mean(0)
        dirs += [(name, i, ro.direction(layer, u)) for name, ro in readouts.items()]
    primary = readouts.get(PRIMARY) or readouts.get(BASELINE)
    if primary is not None and token_sets is not None and token_sets.S and token_sets.N:
        u = token_directions(model, token_sets.S).mean(0) - token_directions(model, token_sets.N).mean(0)
        dirs.append((ENTITLEMENT, None, primary.direction(layer, u)))
    hf = h.float()
    edits = []
    for kind, idx, v in dirs:
        vh = unit(v.to(hf.device, torch.float32))
        c = hf @ vh
        edits.append({"kind": kind, "intermediate": idx, "delta": c * vh})
        for _ in range(n_random):
            r = unit(torch.randn(hf.shape[-1], generator=gen, dtype=torch.float32)).to(hf.device)
            edits.append({"kind": RANDOM + kind, "intermediate": idx, "delta": c.abs() * r})
    return edits


def run_edits(model: Any, ids: torch.Tensor, pos: int, layer: int, deltas: torch.Tensor) -> torch.Tensor:
    """Log-probabilities `[1 + n, V]` of the last position: row 0 unedited, row b+1 with `h[pos] −= deltas[b]`.

    The tokens before `pos` are the same in every row, so on a Hugging Face model they run once and their
    key/value cache is shared by the batch, which then runs only the tokens from `pos` on (for a read at
    the last token: one token per row instead of the whole prompt)."""
    B = deltas.shape[0] + 1
    full = torch.cat([torch.zeros_like(deltas[:1]), deltas]).to(model.device)
    ids = ids.to(model.device)
    hf = getattr(model, "hf", None)
    cache = None
    if hf is not None and pos > 0:
        with torch.no_grad():
            cache = hf(input_ids=ids[None, :pos], use_cache=True).past_key_values
        cache.batch_repeat_interleave(B)
    start = pos if cache is not None else 0

    def edit(h: torch.Tensor) -> torch.Tensor:
        h = h.clone()
        h[:, pos - start] = (h[:, pos - start].float() - full).to(h.dtype)
        return h

    L = model.n_layers
    batch = ids[None, start:].expand(B, -1)
    with torch.no_grad(), capture(model, [L - 1], edit={layer: edit}) as acts:
        if hf is not None and cache is not None:
            hf(input_ids=batch, past_key_values=cache, use_cache=True)
        else:
            run(model, batch)
        return torch.log_softmax(model.unembed(acts[L - 1][:, -1]).float(), dim=-1)


def causal_rows(model: Any, tokenizer: Any, readouts: Mapping[str, Readout], pset: PromptSet,
                token_sets: TokenSets | None, cfg: CausalConfig) -> list[dict[str, Any]]:
    """One row per (item, layer, edit): output KL, top-1 change, answer rank before and after."""
    rows: list[dict[str, Any]] = []
    for n_item, item in enumerate(pset.items):
        ids, pos = encode_item(tokenizer, item, pset.name, force_bos=cfg.force_bos)
        forms = [token_forms(tokenizer, w, pset.name) for w in item.intermediates]
        target_ids = token_forms(tokenizer, item.target, pset.name).ids if item.target else None
        acts = block_outputs(model, ids[None].to(model.device), layers=cfg.layers)
        for layer in cfg.layers:
            gen = torch.Generator(device="cpu").manual_seed(cfg.seed * 1_000_003 + n_item * 1009 + layer)
            edits = item_edits(model, readouts, layer, acts[layer][0, pos], [f.ids for f in forms], token_sets,
                               gen, cfg.n_random)
            logp = run_edits(model, ids, pos, layer, torch.stack([e["delta"] for e in edits]))
            kl = kl_rows(logp[:1].expand_as(logp[1:]), logp[1:])
            top = logp.argmax(-1)
            answer = target_ids if target_ids is not None else [int(top[0])]
            before = min(token_ranks(logp[0], answer))
            for b, e in enumerate(edits, start=1):
                idx = e["intermediate"]
                rows.append({"set": pset.name, "item": item.name, "layer": layer, "kind": e["kind"],
                             "intermediate": None if idx is None else forms[idx].word,
                             "removed_norm": float(e["delta"].norm()), "kl": float(kl[b - 1]),
                             "top1_changed": bool(top[b] != top[0]), "answer_rank_before": before,
                             "answer_rank_after": min(token_ranks(logp[b], answer)),
                             "answer": "target" if target_ids is not None else "model_top1"})
    return rows


def _per_key(rows: Sequence[dict[str, Any]], layer: int, kind: str, field: str,
             keys: Sequence[tuple]) -> np.ndarray:
    """Mean of `field` per (item, intermediate) key over the rows of one layer and edit kind (random draws)."""
    vals: dict[tuple, list[float]] = {}
    for r in rows:
        if r["layer"] == layer and r["kind"] == kind:
            vals.setdefault((r["item"], r["intermediate"]), []).append(float(r[field]))
    return np.asarray([np.mean(vals[k]) for k in keys])


def summarise_causal(rows: Sequence[dict[str, Any]], *, n_boot: int = 1000, seed: int = 0) -> dict[str, Any]:
    """Per layer and edit kind: mean output KL and top-1 change share, the same for its norm-matched random
    control (averaged over draws within an item first), and the paired difference with an item-bootstrap CI."""
    out: dict[str, Any] = {}
    kinds = [k for k in dict.fromkeys(r["kind"] for r in rows) if not k.startswith(RANDOM)]
    for layer in sorted({r["layer"] for r in rows}):
        per: dict[str, Any] = {}
        for kind in kinds:
            lens_rows = [r for r in rows if r["layer"] == layer and r["kind"] == kind]
            if not lens_rows:
                continue
            keys = list(dict.fromkeys((r["item"], r["intermediate"]) for r in lens_rows))
            kl, kl_r = (_per_key(rows, layer, k, "kl", keys) for k in (kind, RANDOM + kind))
            ch, ch_r = (_per_key(rows, layer, k, "top1_changed", keys) for k in (kind, RANDOM + kind))
            entry: dict[str, Any] = {
                "n": len(keys), "kl": float(kl.mean()), "kl_random": float(kl_r.mean()),
                "top1_changed": float(ch.mean()), "top1_changed_random": float(ch_r.mean()),
                "kl_ratio": float(kl.mean() / kl_r.mean()) if kl_r.mean() > 0 else None,
                "answer_rank_worse": float(np.mean([r["answer_rank_after"] > r["answer_rank_before"]
                                                    for r in lens_rows]))}
            # resample items (an item's intermediates stay together)
            ci = ratio_ci(kl - kl_r, None, [k[0] for k in keys], n_boot=n_boot, seed=seed)
            if ci is not None:
                entry["kl_diff_ci"] = list(ci)
            per[kind] = entry
        out[str(layer)] = per
    return out
