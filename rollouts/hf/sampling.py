"""Per-row decoding (`RowSampler`): the sampler picks every row's token itself from the step's
logits — repetition penalty (over the prompt and the tokens so far, as transformers and vLLM
apply it), temperature (0 ⇒ argmax), top-k, top-p, a per-row `torch.Generator` seeded from the
request seed (`row_seed`; one uniform draw per row and step, so a row's randomness does not
depend on its batch; the draw picks the token by inverse CDF in vocabulary order, which last-bit
differences in the logits almost never change), the row's own `max_tokens`. A row's settings are
already resolved against the model's generation config (`HFBackend._submit`). Rows with a JSON
schema are masked by their grammar, which never forces a token: a row still open at its budget
ends with finish "length" (`rollouts/hf/json_guard.py`).
"""
from __future__ import annotations

import hashlib
import logging
import random
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import xgrammar as xgr

from rollouts.hf.rows import Row

if TYPE_CHECKING:
    from rollouts.hf.backend import HFBackend

log = logging.getLogger(__name__)

_GREEDY_EPS = 1e-5


def row_seed(seed: int | None, j: int) -> int:
    if seed is None:
        return random.SystemRandom().getrandbits(63)
    if j == 0:
        return int(seed) & 0x7FFF_FFFF_FFFF_FFFF
    digest = hashlib.sha256(f"{seed}/{j}".encode()).digest()
    return int.from_bytes(digest[:8], "big") & 0x7FFF_FFFF_FFFF_FFFF


def apply_bitmask(backend: HFBackend, logits: Any, bitmask: Any, vocab_size: int, indices: list[int]) -> None:
    """Mask the logits of rows `indices` with xgrammar's kernel `backend.bitmask_kernel`: its C++
    kernel on CPU; on CUDA its Triton kernel, which needs Triton and a C compiler at run time to
    build its launcher. When Triton cannot be imported or compiled, the backend switches for good
    to xgrammar's torch-native kernel (same result, plain torch ops), with one warning."""
    try:
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab_size, indices=indices,
                                        backend=backend.bitmask_kernel)
        return
    except torch.OutOfMemoryError:
        raise
    except Exception as e:  # noqa: BLE001 - Triton fails with ImportError, RuntimeError, its own errors
        if backend.bitmask_kernel != "triton":
            raise
        log.warning("xgrammar's Triton bitmask kernel is unavailable (%s: %s); using its torch-native kernel",
                    type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        backend.bitmask_kernel = "torch_native"
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab_size, indices=indices, backend="torch_native")


def _nucleus_floor(probs: Any, top_p: Any) -> Any:
    """Per row, the smallest probability top-p sampling keeps ([R, 1]): sort descending, keep
    tokens while the mass before them is below top_p. Only the sorted values are needed, and on
    CPU numpy sorts values ~20x faster than torch.sort, which always computes indices too (1 ms for
    8 rows of a 2k vocabulary, the largest cost of a batched step on the tiny model)."""
    if probs.device.type == "cpu":
        desc = np.sort(probs.numpy(), axis=-1)[:, ::-1]
        n_kept = ((np.cumsum(desc, axis=-1) - desc) < top_p.numpy()).sum(axis=-1)
        floor = torch.from_numpy(np.ascontiguousarray(desc[np.arange(len(desc)), n_kept - 1])).unsqueeze(1)
    else:
        sp = torch.sort(probs, dim=-1, descending=True).values
        kept = ((sp.cumsum(dim=-1) - sp) < top_p).sum(dim=-1, keepdim=True)
        floor = sp.gather(1, kept - 1)
    return torch.where(top_p >= 1, torch.zeros_like(floor), floor)  # top_p 1: all, whatever the rounding


class RowSampler:
    """Chooses every row's next token itself (see module doc): `step` for our decode loop, and a
    LogitsProcessor (`__call__`) for the `model.generate` fallback."""

    def __init__(self, backend: HFBackend, rows: list[Row], prompt_width: int = 0):
        self.b = backend
        self.rows = rows
        self.prompt_width = prompt_width
        self.bitmask: torch.Tensor | None = None
        self.interrupted = False
        for r in rows:
            r.tokens, r.finish, r.matcher = [], None, None
            r.generator = torch.Generator().manual_seed(r.seed)
            r.seen = None
            if r.repetition_penalty != 1.0:  # the prompt's tokens count as seen, as in transformers and vLLM
                r.seen = set(r.prompt_ids)
            if r.grammar is not None:
                r.matcher = xgr.GrammarMatcher(r.grammar.compiled, override_stop_tokens=backend.stop_ids)
        if any(r.grammar is not None for r in rows):
            self.bitmask = xgr.allocate_token_bitmask(len(rows), backend.vocab_size)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """LogitsProcessor form (the `model.generate` fallback): scores[i] belongs to rows[i]."""
        picks = self.step(scores, range(scores.shape[0]), input_ids.shape[1] - self.prompt_width)
        nrows = scores.shape[0]
        out = torch.full_like(scores, float("-inf"))
        out[torch.arange(nrows, device=scores.device), torch.tensor(picks, device=scores.device)] = 0.0
        return out

    def step(self, scores: torch.Tensor, active: Sequence[int], k: int) -> list[int]:
        """Choose the next token of every row, `k` tokens into the decode: scores[p] are the logits
        of row `active[p]`. Returns the token to feed at each position (the stop token for rows
        that end now, the pad token for rows that had already ended)."""
        b = self.b
        rows = [self.rows[a] for a in active]
        nrows, vocab = scores.shape
        chosen: dict[int, int] = {}
        live = [i for i, r in enumerate(rows) if r.finish is None]
        if b._closed and live:  # aclose(): end every row now so the decode thread returns promptly
            self.interrupted = True
            for i in live:
                rows[i].finish = "length"
                chosen[i] = b.stop_ids[0]
            live = []
        # 1) rows whose budget is spent end here, cut ("length"), whatever their grammar's state
        sample_rows = []
        for i in live:
            r = rows[i]
            if r.max_tokens - k <= 0:
                chosen[i] = b.stop_ids[0]
                r.finish = "length"
            else:
                sample_rows.append(i)
        if sample_rows:
            logits = scores.float()
            if b.n_tokenizer < vocab:
                logits[:, b.n_tokenizer:] = float("-inf")
            for i in sample_rows:
                seen = rows[i].seen
                if seen is not None:
                    _penalise_repeats(logits, i, seen, rows[i].repetition_penalty)
            constrained = [i for i in sample_rows if rows[i].matcher is not None]
            if constrained:
                bitmask = self.bitmask
                assert bitmask is not None  # allocated in __init__ when a row has a grammar
                for i in constrained:
                    rows[i].matcher.fill_next_token_bitmask(bitmask, i)
                apply_bitmask(b, logits, bitmask.to(logits.device), min(vocab, b.vocab_size), constrained)
                if b.banned_ids_tensor is not None:
                    idx = torch.tensor(constrained, device=logits.device)
                    logits[idx.unsqueeze(1), b.banned_ids_tensor.unsqueeze(0)] = float("-inf")
            greedy = [i for i in sample_rows if rows[i].temperature < _GREEDY_EPS]
            sampled = [i for i in sample_rows if rows[i].temperature >= _GREEDY_EPS]
            if greedy:
                picks: list[int] = logits[greedy].argmax(dim=-1).tolist()
                chosen.update(zip(greedy, picks, strict=True))
            if sampled:
                chosen.update(zip(sampled, self._sample(logits, [rows[i] for i in sampled], sampled), strict=True))
        # 2) grammar bookkeeping: the grammar advances by the sampled token (its mask allowed it)
        for i in live:
            r = rows[i]
            tok = chosen[i]
            if r.matcher is not None and r.finish is None and not r.matcher.accept_token(tok):
                r.finish = "length"  # cannot happen with a valid mask; end the row, cut
                chosen[i] = b.stop_ids[0]
                continue
            if r.finish is None:
                if tok in b.stop_set:
                    r.finish = "stop"
                else:
                    r.tokens.append(tok)
                    if r.seen is not None:
                        r.seen.add(tok)
        return [chosen.get(i, b.pad_id) for i in range(nrows)]

    def expire(self, k: int) -> None:
        """End (finish "length") the live rows that have no budget left `k` tokens into the decode:
        what `step` would do at step `k` without looking at the logits, so the caller can skip
        computing them."""
        for r in self.rows:
            if r.finish is None and r.max_tokens - k <= 0:
                r.finish = "length"

    def _sample(self, logits: torch.Tensor, rows: list[Row], pos: list[int]) -> list[int]:
        temps = torch.tensor([r.temperature for r in rows], device=logits.device).unsqueeze(1)
        top_p = torch.tensor([r.top_p for r in rows], device=logits.device).unsqueeze(1)
        u = torch.tensor([float(torch.rand(1, generator=r.generator)) for r in rows],
                         device=logits.device, dtype=torch.float32).unsqueeze(1)
        scaled = logits[pos] / temps
        for p, r in enumerate(rows):  # top-k: keep the k most likely tokens (ties at the k-th kept)
            if 0 < r.top_k < scaled.shape[1]:
                kth = torch.topk(scaled[p], r.top_k).values[-1]
                scaled[p] = scaled[p].masked_fill(scaled[p] < kth, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        if bool((top_p < 1).any()):  # nucleus: keep the most likely tokens up to top_p of the mass
            probs = probs * (probs >= _nucleus_floor(probs, top_p))
        # Inverse CDF in vocabulary order, not sorted order: a difference in the last bit of two
        # near-equal logits (a chunked vs a full prefill) reorders a sort, but moves this CDF only
        # by that much, so the token changes only if the draw falls right on a boundary.
        cdf = probs.cumsum(dim=-1)
        at = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp(max=probs.shape[1] - 1)
        tokens: list[int] = at.squeeze(1).tolist()
        return tokens


def _penalise_repeats(logits: torch.Tensor, i: int, seen: set[int], penalty: float) -> None:
    """The repetition penalty of transformers and vLLM on row `i`: the logit of every token `seen`
    (prompt and output) is divided by the penalty when positive, multiplied when negative."""
    ids = torch.tensor(sorted(seen), dtype=torch.long, device=logits.device)
    vals = logits[i, ids]
    logits[i, ids] = torch.where(vals > 0, vals / penalty, vals * penalty)
