"""Teacher-forced log-probabilities of short continuations after shared prompts, batched, with an
optional steering vector added at the prompt's last token (entitle lite mode and its steering arm).

A prompt is run once without its last token, and its key/value cache is shared by every
continuation (each suffix row is `[last prompt token] + continuation`), so k continuations or k
steering directions cost about one prompt's forward pass. Steering (`Suffix.direction`) adds
`alpha · |h| · unit` at block `layer` on the suffix's first position only (the rule of
`rollouts.hf.steering`); rows of one pass may carry different directions and strengths."""
from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

#: prompt tokens x rows held in one pass's key/value copies (~0.4 GB for SmolLM2-135M in fp32)
KV_ROWS_TOKENS = 8192


@dataclass(frozen=True)
class Suffix:
    """One continuation to score after prompt number `prompt`; `direction` indexes the unit vectors
    passed to `score_suffixes` (None: unsteered), `alpha` its strength in units of |h|."""

    prompt: int
    tokens: tuple[int, ...]
    direction: int | None = None
    alpha: float = 0.0


@dataclass(frozen=True)
class Scored:
    """Per continuation token: its log-probability; and at the first position (the prompt's last
    token): the arg-max token and the log-sum-exp of each requested token set."""

    token_logprobs: tuple[float, ...]
    top1: int
    set_lse: tuple[float, ...] = ()

    @property
    def logprob(self) -> float:
        return float(sum(self.token_logprobs))


def _decoder(model: Any) -> Any:
    return model.hf if hasattr(model, "hf") else model


def _pad_id(model: Any) -> int:
    cfg = _decoder(model).config
    pid = getattr(cfg, "pad_token_id", None)
    if pid is None:
        pid = getattr(cfg, "eos_token_id", None)
    if isinstance(pid, list):
        pid = pid[0]
    return int(pid or 0)


@torch.no_grad()
def prefix_cache(model: Any, prompts: Sequence[Sequence[int]]) -> tuple[list[tuple[torch.Tensor, torch.Tensor]],
                                                                       torch.Tensor]:
    """The key/value tensors of each prompt without its last token, and the attention mask `[B, P]`
    over their positions. The prompts' longest common prefix is run once (a fact's cells share the
    system line, the question and the file up to the evidence line); each prompt's remainder
    follows it, right-padded, so a padded position sits between a prompt's end and the suffix and
    is masked there."""
    from transformers import DynamicCache

    hf = _decoder(model)
    device = next(hf.parameters()).device
    if any(len(p) < 2 for p in prompts):
        raise ValueError("every prompt needs at least two tokens")
    heads = [list(p[:-1]) for p in prompts]
    common = 0
    while all(len(h) > common for h in heads) and len({h[common] for h in heads}) == 1:
        common += 1
    pad = _pad_id(model)
    width = max(len(h) for h in heads) - common
    rest = torch.full((len(heads), width), pad, dtype=torch.long)
    rest_mask = torch.zeros((len(heads), width), dtype=torch.long)
    for i, h in enumerate(heads):
        rest[i, :len(h) - common] = torch.tensor(h[common:], dtype=torch.long)
        rest_mask[i, :len(h) - common] = 1
    with warnings.catch_warnings():  # transformers 5.24 renames `past_key_values`; 5.17 knows only that name
        warnings.simplefilter("ignore", FutureWarning)
        kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        if common:
            out = hf(input_ids=torch.tensor([heads[0][:common]], device=device), use_cache=True, logits_to_keep=1)
            kv = [(layer.keys.expand(len(heads), -1, -1, -1), layer.values.expand(len(heads), -1, -1, -1))
                  for layer in out.past_key_values.layers]
        mask = torch.cat([torch.ones((len(heads), common), dtype=torch.long), rest_mask], dim=1)
        if width:
            cache = DynamicCache(ddp_cache_data=[(k.contiguous(), v.contiguous()) for k, v in kv]) if kv else None
            pos = common + torch.arange(width)[None, :].expand(len(heads), -1)
            out = hf(input_ids=rest.to(device), attention_mask=mask.to(device), position_ids=pos.to(device),
                     past_key_values=cache, use_cache=True, logits_to_keep=1)
            kv = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
    return kv, mask


def _steer_hook(units: torch.Tensor, alphas: torch.Tensor):
    """Add `alpha_r · |h_r| · unit_r` to row r's first position (rows with alpha 0 unchanged)."""
    def hook(_module: torch.nn.Module, _inputs: Any, output: Any) -> Any:
        h = output[0] if isinstance(output, (tuple, list)) else output
        first = h[:, 0, :]
        add = alphas.to(h.dtype)[:, None] * first.norm(dim=-1, keepdim=True) * units.to(h.dtype)
        h = h.clone()
        h[:, 0, :] = first + add
        return (h, *output[1:]) if isinstance(output, (tuple, list)) else h
    return hook


@torch.no_grad()
def score_suffixes(model: Any, prompts: Sequence[Sequence[int]], suffixes: Sequence[Suffix], *,
                   layer: int | None = None, units: torch.Tensor | None = None,
                   token_sets: Sequence[Sequence[int]] = (), rows_per_pass: int = 64) -> list[Scored]:
    """Score every suffix (module doc). `units` `[k, d]`: the unit directions that `Suffix.direction`
    indexes, added at block `layer`; `token_sets`: id lists whose log-sum-exp is reported at the first
    position (e.g. the N and S words)."""
    from transformers import DynamicCache

    hf = _decoder(model)
    device = next(hf.parameters()).device
    steered = any(s.direction is not None and s.alpha != 0 for s in suffixes)
    if steered and (units is None or layer is None):
        raise ValueError("steered suffixes need `units` and `layer`")
    kv, mask = prefix_cache(model, prompts)
    lengths = [len(p) for p in prompts]
    pad = _pad_id(model)
    blocks = getattr(model, "blocks", None)
    sets = [torch.as_tensor(list(t), dtype=torch.long, device=device) for t in token_sets]
    # each row holds its own copy of its prompt's keys and values: cap the rows of a pass by their length
    rows_per_pass = max(1, min(rows_per_pass, KV_ROWS_TOKENS // max(1, int(mask.shape[1]))))
    out: list[Scored] = []
    for start in range(0, len(suffixes), rows_per_pass):
        chunk = suffixes[start:start + rows_per_pass]
        rows = torch.tensor([s.prompt for s in chunk], dtype=torch.long)
        width = 1 + max(len(s.tokens) for s in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        for i, s in enumerate(chunk):
            seq = [prompts[s.prompt][-1], *s.tokens]
            ids[i, :len(seq)] = torch.tensor(seq)  # right padding: later positions never reach earlier ones
        cache = DynamicCache(ddp_cache_data=[(k[rows.to(k.device)], v[rows.to(v.device)]) for k, v in kv])
        att = torch.cat([mask[rows], torch.ones((len(chunk), width), dtype=torch.long)], dim=1)
        pos = torch.tensor([lengths[s.prompt] - 1 for s in chunk])[:, None] + torch.arange(width)[None, :]
        handle = None
        if steered:
            assert units is not None and layer is not None and blocks is not None
            idx = [s.direction if s.direction is not None else 0 for s in chunk]
            alphas = torch.tensor([s.alpha if s.direction is not None else 0.0 for s in chunk], device=device)
            handle = blocks[layer].register_forward_hook(_steer_hook(units[idx].to(device), alphas))
        try:
            with warnings.catch_warnings():  # transformers 5.24 renames the argument; 5.17 knows only this name
                warnings.simplefilter("ignore", FutureWarning)
                logits = hf(input_ids=ids.to(device), attention_mask=att.to(device), position_ids=pos.to(device),
                            past_key_values=cache, use_cache=True).logits.float()
        finally:
            if handle is not None:
                handle.remove()
        logp = torch.log_softmax(logits, dim=-1)
        for i, s in enumerate(chunk):
            n = len(s.tokens)
            tok = torch.tensor(s.tokens, dtype=torch.long, device=device)
            lp = logp[i, torch.arange(n, device=device), tok] if n else torch.empty(0)
            first = logp[i, 0]
            out.append(Scored(token_logprobs=tuple(float(x) for x in lp), top1=int(first.argmax()),
                              set_lse=tuple(float(torch.logsumexp(first[t], 0)) for t in sets)))
    return out
