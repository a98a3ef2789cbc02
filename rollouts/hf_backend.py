"""`hf` backend: transformers in-process, batched across concurrent callers, per-row sampling,
JSON-schema constrained decoding with xgrammar. CPU-capable (tests, tiny demo, lens).

How a call flows:
  `await backend.generate([req])` → the request is tokenised with the chat template, checked
  against the context length, expanded into `n` rows and queued. One worker task per event
  loop takes up to `max_batch_size` queued rows (waiting up to `batch_wait_ms` to fill; rows of
  one batch share one LoRA adapter), decodes them together in a thread (`asyncio.to_thread`),
  and resolves each request when all of its rows are done.

The batched decode is our own loop (`HFBackend._decode_loop`), not `model.generate`: every
distinct prompt is prefilled alone (batch 1, no padding and no mask, so attention takes the
fast causal path; a left-padded batch with a mask is much slower on CPU for long prompts), its
keys/values are copied into one left-padded batched cache (preallocated buffers, a padding
mask, per-row position ids continuing each row's own length), and the rows then decode one
token per step together; finished rows are dropped from the batch. Models whose layers are not
all full attention (sliding windows, linear attention) decode with one left-padded
`model.generate` instead, with the same sampler as its logits processor.

Prefix cache (`rollouts/prefix_cache.py`, our loop only): a prompt's prefill starts from the
longest token prefix whose keys/values an earlier request left (its prompt, or its prompt plus
the answer it generated), so a conversation's next turn computes only its new tokens.
`GenerationResult.cached_tokens` reports the reused count, as vLLM reports its cache hits.

Per-row decoding (`_RowSampler`): the sampler picks every row's token itself from the step's
logits — temperature (0 ⇒ argmax), top-p, a per-row `torch.Generator` seeded from the request
seed (one uniform draw per row and step, so a row's randomness does not depend on its batch;
the draw picks the token by inverse CDF in vocabulary order, which last-bit differences in the
logits almost never change), the row's own `max_tokens`.

JSON termination guarantee (rows with a `json_schema`): the grammar is compiled with
`any_whitespace=False` and applied as a token bitmask (special tokens other than the stop
tokens are masked too). xgrammar 0.2.9 does enforce `maxLength`, `maxItems` and numeric
`minimum`/`maximum`, but a schema's total length can still exceed the token budget, and plain
strings are unbounded. So each constrained row also carries a *closing path*: an explicit token
sequence that takes the grammar from the current state to termination (stop token included),
found by a deterministic policy (`_Closer.path`: forced jump-forward tokens; else the stop token
when the JSON is complete; else the first allowed of `" ] } , 0-9 …` single-byte tokens; else the
first allowed token). Invariant: len(closing path) <= tokens left. After the row samples a
token, the old path is re-verified from the new state (`accept_token` only, cheap) or a new one
is searched; if no path fits in the remaining budget the sampled token is rejected and the next
token of the current path is emitted instead; once the path length equals the budget the row
follows it. The output therefore always terminates with a complete JSON document and
finish_reason "stop", as long as the schema's shortest document (by the policy) fits in
`max_tokens` (otherwise the row decodes unguarded and may end with "length";
`stats["json_unguarded_rows"]` counts those). The policy can loop on string `pattern`s it cannot
satisfy with ASCII; the search is capped by the budget, so that also only drops the guarantee.

Token accounting: `Completion.token_ids` are the generated tokens without the final stop
token; `completion_tokens` is their sum over the n completions. Text is decoded with special
tokens skipped; think text is left in place (the performer strips it).
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import inspect
import json
import logging
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollouts.backend import BackendError
from rollouts.model_files import check_adapter_dir, check_model_dir, one_line
from rollouts.prefix_cache import PrefixCache
from rollouts.spec import ModelSpec
from rollouts.types import Completion, GenerationRequest, GenerationResult

log = logging.getLogger(__name__)

_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "fp16": "float16", "half": "float16"}
# Single characters the closing policy tries, in order: close strings, close containers, end a
# value, digits for numbers, then any printable ASCII (enum/keys/patterns/booleans).
_CLOSE_PRIORITY = '"]},0123456789' + "".join(
    c for c in (chr(i) for i in range(0x20, 0x7F)) if c not in '"]},0123456789')
_GREEDY_EPS = 1e-5
# Batched decode: finished rows are dropped from the batch once they are this share of it (0: at
# once; measured on 16 rows of 3-7k tokens with budgets 16-200, decode time 0.76 s dropping at
# once, 0.79 s at half, 1.19 s never), and the cache and mask grow by this many columns at a time.
_COMPACT_FRACTION = 0.0
_CAPACITY_STEP = 256
_ENCODE_CACHE_SIZE = 128  # chat-template encodings kept (see `encode_chat`)
# A prefill that continues a cached prefix runs attention with an explicit mask (the new tokens
# see all of the prefix, and each other causally), which on CPU takes sdpa's masked path: ~3.5x
# slower per query/key pair than the causal kernel a full prefill uses. Measured on the tiny
# Llama (benchmarks/rollout_throughput.py machine), continuing P cached tokens with q new ones
# beats a full prefill once q <= P/2: (P, q) = (4000, 400) 20 ms vs 68 ms, (3000, 1000) 41 vs
# 57 ms, (2000, 2000) 84 vs 58 ms, (300, 7000) 646 vs 167 ms. On CPU a shorter match is ignored.
_CPU_REUSE_MAX_NEW_PER_CACHED = 0.5


def _row_seed(seed: int | None, j: int) -> int:
    if seed is None:
        return random.SystemRandom().getrandbits(63)
    if j == 0:
        return int(seed) & 0x7FFF_FFFF_FFFF_FFFF
    digest = hashlib.sha256(f"{seed}/{j}".encode()).digest()
    return int.from_bytes(digest[:8], "big") & 0x7FFF_FFFF_FFFF_FFFF


class _Closer:
    """Finds closing paths for one tokenizer: token sequences that drive a GrammarMatcher to
    termination. Only used from the decode thread."""

    def __init__(self, info: Any, stop_ids: list[int], special_ids: set[int], vocab_size: int):
        import numpy as np
        import xgrammar as xgr

        self._np = np
        self.stop_id = stop_ids[0]
        decoded = info.decoded_vocab
        first: dict[bytes, int] = {}
        for tid, b in enumerate(decoded):
            if len(b) == 1 and tid not in special_ids and b not in first:
                first[b] = tid
        self.candidates = np.array(
            [self.stop_id] + [first[c.encode()] for c in _CLOSE_PRIORITY if c.encode() in first], dtype=np.int64)
        self.closers = [first[c] for c in (b"]", b"}") if c in first]
        self.quote = first.get(b'"', -1)
        self.banned = np.array(sorted(special_ids - set(stop_ids)), dtype=np.int64)
        self.vocab_size = vocab_size
        self._xgr = xgr
        self._local = threading.local()  # one scratch bitmask per thread

    def _mask(self, matcher: Any, slot: str) -> Any:
        scratch = getattr(self._local, slot, None)
        if scratch is None:
            scratch = self._xgr.allocate_token_bitmask(1, self.vocab_size)
            setattr(self._local, slot, scratch)
        matcher.fill_next_token_bitmask(scratch, 0)
        return scratch[0].numpy()

    @staticmethod
    def _allowed(words: Any, tok: int) -> bool:
        return tok >= 0 and bool((int(words[tok >> 5]) >> (tok & 31)) & 1)

    def _choose(self, matcher: Any) -> int | None:
        np = self._np
        words = self._mask(matcher, "m0")
        # A container closer goes first when it really closes something: after a real `]`/`}`
        # a `"` can never follow directly, while inside a string `]`/`}` are plain characters
        # after which the closing `"` stays allowed.
        for tok in self.closers:
            if self._allowed(words, tok):
                probe = matcher.fork()
                if probe.accept_token(tok) and not self._allowed(self._mask(probe, "m1"), self.quote):
                    return tok
        cand = self.candidates
        ok = (words[cand >> 5] >> (cand & 31)) & 1
        nz = np.flatnonzero(ok)
        if len(nz):
            return int(cand[nz[0]])
        bits = np.unpackbits(words.view(np.uint8), bitorder="little")[: self.vocab_size].copy()
        if len(self.banned):
            bits[self.banned] = 0
        nz = np.flatnonzero(bits)
        return int(nz[0]) if len(nz) else None

    def path(self, matcher: Any, cap: int) -> list[int] | None:
        """The policy's closing path from `matcher`'s state (not modified), or None if it needs
        more than `cap` tokens or gets stuck."""
        m = matcher.fork()
        out: list[int] = []
        while not m.is_terminated():
            if len(out) >= cap:
                return None
            if m.is_completed():
                tok = self.stop_id
            else:
                forced = m.find_jump_forward_tokens()
                if forced:
                    for tok in forced:
                        if len(out) >= cap or not m.accept_token(tok):
                            return None
                        out.append(tok)
                    continue
                tok = self._choose(m)
                if tok is None:
                    return None
            if not m.accept_token(tok):
                return None
            out.append(tok)
        return out

    @staticmethod
    def verify(matcher: Any, path: list[int]) -> bool:
        """Whether `path` still takes `matcher` (not modified) to termination."""
        m = matcher.fork()
        for tok in path:
            if not m.accept_token(tok):
                return False
        return m.is_terminated()


@dataclass
class _Grammar:
    compiled: Any
    initial_path: list[int] | None  # closing path from the start state (None: none found)


@dataclass
class _Pending:
    request: GenerationRequest
    future: asyncio.Future
    t0: float
    prompt_ids: list[int]
    completions: list[Completion | None]
    remaining: int
    cached_tokens: int = 0  # prompt tokens whose keys/values came from the prefix cache


@dataclass
class _Row:
    pending: _Pending
    j: int
    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    grammar: _Grammar | None
    adapter: str | None
    # decode state (reset at the start of every batch run)
    tokens: list[int] = field(default_factory=list)
    finish: str | None = None
    matcher: Any = None
    path: list[int] | None = None
    generator: Any = None


_BUFFER_LAYER: Any = None


def _buffer_layer_class() -> Any:
    """`_BufferLayer`, a transformers `DynamicLayer` over preallocated [B, H, capacity, D] key and
    value buffers (defined lazily: transformers is imported on first use)."""
    global _BUFFER_LAYER
    if _BUFFER_LAYER is not None:
        return _BUFFER_LAYER
    from transformers.cache_utils import DynamicLayer

    class _BufferLayer(DynamicLayer):
        """One layer of the batched decode cache. A decode step writes its column into the
        buffers (DynamicLayer re-concatenates the whole cache every step); `keys`/`values` are
        views of the filled part. Rows are left-padded: row i's prompt ends at the same column
        for every row, and the attention mask hides the padding."""

        def __init__(self, kbuf: Any, vbuf: Any, length: int):
            super().__init__()
            self.kbuf, self.vbuf, self.length = kbuf, vbuf, length
            self.device = kbuf.device
            self.is_initialized = True
            self._views()

        def _views(self) -> tuple[Any, Any]:
            self.keys = self.kbuf[:, :, : self.length]
            self.values = self.vbuf[:, :, : self.length]
            return self.keys, self.values

        def update(self, key_states: Any, value_states: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
            end = self.length + key_states.shape[-2]
            if end > self.kbuf.shape[-2]:
                self.reserve(end + max(64, end // 8))
            self.kbuf[:, :, self.length:end] = key_states
            self.vbuf[:, :, self.length:end] = value_states
            self.length = end
            return self._views()

        def reserve(self, capacity: int) -> None:
            if capacity > self.kbuf.shape[-2]:
                grown = []
                for buf in (self.kbuf, self.vbuf):
                    new = buf.new_empty(buf.shape[:2] + (capacity,) + buf.shape[3:])
                    new[:, :, : self.length] = buf[:, :, : self.length]
                    grown.append(new)
                self.kbuf, self.vbuf = grown
                self._views()

        def get_seq_length(self) -> int:
            return self.length

        def keep(self, index: Any, start: int) -> None:
            """Keep batch rows `index` (a tensor) and drop the first `start` columns."""
            self.kbuf = self.kbuf[index, :, start:]
            self.vbuf = self.vbuf[index, :, start:]
            self.length -= start
            self._views()

    _BUFFER_LAYER = _BufferLayer
    return _BufferLayer


def _nucleus_floor(probs: Any, top_p: Any) -> Any:
    """Per row, the smallest probability top-p sampling keeps ([R, 1]): sort descending, keep
    tokens while the mass before them is below top_p. Only the sorted values are needed, and on
    CPU numpy sorts values ~20x faster than torch.sort, which always computes indices too (1 ms for
    8 rows of a 2k vocabulary, the largest cost of a batched step on the tiny model)."""
    import numpy as np
    import torch

    if probs.device.type == "cpu":
        sp = np.sort(probs.numpy(), axis=-1)[:, ::-1]
        kept = ((np.cumsum(sp, axis=-1) - sp) < top_p.numpy()).sum(axis=-1)
        floor = torch.from_numpy(np.ascontiguousarray(sp[np.arange(len(sp)), kept - 1])).unsqueeze(1)
    else:
        sp = torch.sort(probs, dim=-1, descending=True).values
        kept = ((sp.cumsum(dim=-1) - sp) < top_p).sum(dim=-1, keepdim=True)
        floor = sp.gather(1, kept - 1)
    return torch.where(top_p >= 1, torch.zeros_like(floor), floor)  # top_p 1: all, whatever the rounding


class _RowSampler:
    """Chooses every row's next token itself (see module doc): `step` for our decode loop, and a
    LogitsProcessor (`__call__`) for the `model.generate` fallback."""

    def __init__(self, backend: "HFBackend", rows: list[_Row], prompt_width: int = 0):
        import torch
        import xgrammar as xgr

        self.b = backend
        self.rows = rows
        self.prompt_width = prompt_width
        self.torch = torch
        self.xgr = xgr
        self.bitmask = None
        self.rejections = 0
        self.interrupted = False
        for r in rows:
            r.tokens, r.finish, r.matcher, r.path = [], None, None, None
            r.generator = torch.Generator().manual_seed(r.seed)
            if r.grammar is not None:
                r.matcher = xgr.GrammarMatcher(r.grammar.compiled, override_stop_tokens=backend.stop_ids)
                ip = r.grammar.initial_path
                r.path = list(ip) if ip is not None and len(ip) <= r.max_tokens else None
                if r.path is None:
                    backend.stats["json_unguarded_rows"] += 1
                    need = len(ip) if ip is not None else "unknown"
                    log.warning("JSON row decodes without the termination guard: max_tokens=%d but the "
                                "schema's shortest document needs %s tokens", r.max_tokens, need)
        if any(r.grammar is not None for r in rows):
            self.bitmask = xgr.allocate_token_bitmask(len(rows), backend.vocab_size)

    def __call__(self, input_ids, scores):
        """LogitsProcessor form (the `model.generate` fallback): scores[i] belongs to rows[i]."""
        torch = self.torch
        picks = self.step(scores, range(scores.shape[0]), input_ids.shape[1] - self.prompt_width)
        nrows = scores.shape[0]
        out = torch.full_like(scores, float("-inf"))
        out[torch.arange(nrows, device=scores.device), torch.tensor(picks, device=scores.device)] = 0.0
        return out

    def step(self, scores, active, k: int) -> list[int]:
        """Choose the next token of every row, `k` tokens into the decode: scores[p] are the logits
        of row `active[p]`. Returns the token to feed at each position (the stop token for rows
        that end now, the pad token for rows that had already ended)."""
        torch = self.torch
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
        # 1) rows whose token is fixed: budget exhausted, or the closing path is as long as the budget
        sample_rows = []
        for i in live:
            r = rows[i]
            left = r.max_tokens - k
            if r.path is not None and len(r.path) >= left:
                chosen[i] = r.path[0]
            elif left <= 0:
                chosen[i] = b.stop_ids[0]
                r.finish = "length"
            else:
                sample_rows.append(i)
        if sample_rows:
            logits = scores.float()
            if b.n_tokenizer < vocab:
                logits[:, b.n_tokenizer:] = float("-inf")
            constrained = [i for i in sample_rows if rows[i].matcher is not None]
            if constrained:
                for i in constrained:
                    rows[i].matcher.fill_next_token_bitmask(self.bitmask, i)
                self.xgr.apply_token_bitmask_inplace(
                    logits, self.bitmask.to(logits.device), vocab_size=min(vocab, b.vocab_size), indices=constrained)
                if b.banned_ids_tensor is not None:
                    idx = torch.tensor(constrained, device=logits.device)
                    logits[idx.unsqueeze(1), b.banned_ids_tensor.unsqueeze(0)] = float("-inf")
            greedy = [i for i in sample_rows if rows[i].temperature < _GREEDY_EPS]
            sampled = [i for i in sample_rows if rows[i].temperature >= _GREEDY_EPS]
            if greedy:
                picks = logits[greedy].argmax(dim=-1).tolist()
                chosen.update(zip(greedy, picks))
            if sampled:
                chosen.update(zip(sampled, self._sample(logits, [rows[i] for i in sampled], sampled)))
        # 2) grammar bookkeeping: keep a closing path that fits the budget, or override the sample
        for i in live:
            r = rows[i]
            tok = chosen[i]
            if r.matcher is not None and r.finish is None:
                tok = self._guard(r, tok, r.max_tokens - k)
                chosen[i] = tok
                if not r.matcher.accept_token(tok):  # cannot happen with a valid mask; end the row
                    r.finish = "length"
                    chosen[i] = b.stop_ids[0]
                    continue
            if r.finish is None:
                if tok in b.stop_set:
                    r.finish = "stop"
                else:
                    r.tokens.append(tok)
        return [chosen.get(i, b.pad_id) for i in range(nrows)]

    def expire(self, k: int) -> None:
        """End (finish "length") the live rows that have no budget left `k` tokens into the decode:
        what `step` would do at step `k` without looking at the logits, so the caller can skip
        computing them. Guarded rows never get here: their closing path ends them earlier."""
        for r in self.rows:
            if r.finish is None and r.max_tokens - k <= 0 and not r.path:
                r.finish = "length"

    def _sample(self, logits, rows: list[_Row], pos: list[int]) -> list[int]:
        torch = self.torch
        temps = torch.tensor([r.temperature for r in rows], device=logits.device).unsqueeze(1)
        top_p = torch.tensor([r.top_p for r in rows], device=logits.device).unsqueeze(1)
        u = torch.tensor([float(torch.rand(1, generator=r.generator)) for r in rows],
                         device=logits.device, dtype=torch.float32).unsqueeze(1)
        probs = torch.softmax(logits[pos] / temps, dim=-1)
        if bool((top_p < 1).any()):  # nucleus: keep the most likely tokens up to top_p of the mass
            probs = probs * (probs >= _nucleus_floor(probs, top_p))
        # Inverse CDF in vocabulary order, not sorted order: a difference in the last bit of two
        # near-equal logits (a chunked vs a full prefill) reorders a sort, but moves this CDF only
        # by that much, so the token changes only if the draw falls right on a boundary.
        cdf = probs.cumsum(dim=-1)
        at = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp(max=probs.shape[1] - 1)
        return at.squeeze(1).tolist()

    def _guard(self, r: _Row, tok: int, left: int) -> int:
        """Return the token to emit for constrained row `r` with `left` tokens of budget
        (this one included) and update r.path so that len(r.path) <= left - 1 afterwards."""
        closer = self.b.closer
        if r.path is None:  # unguarded row
            return tok
        if r.path and tok == r.path[0]:
            r.path = r.path[1:]
            return tok
        after = r.matcher.fork()
        new_path = None
        if after.accept_token(tok):
            if len(r.path) <= left - 1 and closer.verify(after, r.path):
                new_path = r.path
            else:
                new_path = closer.path(after, cap=left - 1)
        if new_path is None:  # the sample cannot be closed within budget: follow the path instead
            self.rejections += 1
            tok, r.path = r.path[0], r.path[1:]
            return tok
        r.path = new_path
        return tok


class HFBackend:
    """transformers in-process backend. Build with `HFBackend.from_spec(spec)`."""

    def __init__(self, spec: ModelSpec, model: Any, tokenizer: Any, device: str, dtype: Any):
        import torch

        self.spec = spec
        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        self.dtype = dtype
        self.model_id = spec.model
        cfg = self._base_model().config
        self.vocab_size = int(getattr(cfg.get_text_config(), "vocab_size", None) or len(tokenizer))  # lm_head rows
        self.n_tokenizer = min(len(tokenizer), self.vocab_size)
        text_cfg = cfg.get_text_config()
        self.max_model_len = int(spec.max_model_len or getattr(text_cfg, "max_position_embeddings", 0) or 10**9)
        # Our decode loop keeps every layer's full key/value history and calls the model with the
        # transformers 5 forward arguments; other models (sliding-window or linear-attention
        # layers, remote code with another signature) decode with `model.generate` instead.
        params = inspect.signature(self._base_model().forward).parameters
        self._own_loop = (all(t == "full_attention" for t in getattr(text_cfg, "layer_types", None) or [])
                          and not getattr(text_cfg, "sliding_window", None)
                          and all(p in params for p in ("cache", "position_ids", "logits_to_keep")))
        gen_cfg = self._base_model().generation_config
        stops: list[int] = []
        eos = getattr(gen_cfg, "eos_token_id", None)
        for t in ([eos] if isinstance(eos, int) else list(eos or [])) + [tokenizer.eos_token_id]:
            if t is not None and int(t) not in stops and int(t) < self.vocab_size:
                stops.append(int(t))
        if not stops:
            raise BackendError(f"{spec.model}: tokenizer and generation config define no eos token")
        self.stop_ids = stops
        self.stop_set = set(stops)
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else stops[0])
        special = {int(i) for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special}
        special |= {int(i) for i in tokenizer.all_special_ids if i is not None}
        self.special_ids = {i for i in special if i < self.vocab_size}
        banned = sorted(self.special_ids - self.stop_set)
        self.banned_ids_tensor = torch.tensor(banned, dtype=torch.long, device=device) if banned else None
        self._orig_generation_config = gen_cfg
        from transformers import GenerationConfig

        # A clean generation config so no processor from the model's own defaults (repetition
        # penalty, top_k, suppress tokens, ...) alters the logits our sampler sees.
        self._base_model().generation_config = GenerationConfig(
            eos_token_id=stops, pad_token_id=self.pad_id, bos_token_id=getattr(gen_cfg, "bos_token_id", None))
        self._tok_lock = threading.Lock()
        self._encoded: collections.OrderedDict[Any, Any] = collections.OrderedDict()
        self._run_lock = threading.Lock()
        self._grammar_lock = threading.Lock()
        self._grammars: dict[str, _Grammar] = {}
        self._xgr_info = None
        self._compiler = None
        self._closer: _Closer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: collections.deque[_Row] = collections.deque()
        self._wakeup: asyncio.Event | None = None
        self._worker: asyncio.Task | None = None
        self._inflight: list[_Row] = []
        self._closed = False
        self.prefix_cache = PrefixCache(int(spec.prefix_cache_gib * 2**30) if spec.enable_prefix_caching else 0)
        self.batches_run = 0
        self.busy_s = 0.0  # time spent inside batched decodes: the backend's own cost
        # where busy_s goes (our decode loop; on CUDA without synchronising, so only indicative)
        self.timings: dict[str, float] = collections.Counter(prefill_s=0.0, forward_s=0.0, sample_s=0.0)
        self.stats: dict[str, int] = collections.Counter(
            batches=0, rows=0, max_batch_rows=0, decode_steps=0, json_rows=0,
            json_rejections=0, json_unguarded_rows=0, prefill_tokens=0, prefix_reused_tokens=0,
            prefix_matches_ignored=0)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_spec(cls, spec: ModelSpec) -> "HFBackend":
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if spec.backend != "hf":
            raise BackendError(f"HFBackend needs a spec with backend 'hf', got {spec.backend!r}")
        device = spec.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise BackendError(f"{spec.model}: device {device!r} requested but CUDA is not available")
        if spec.dtype == "auto":
            dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        elif spec.dtype in _DTYPES:
            dtype = getattr(torch, _DTYPES[spec.dtype])
        else:
            raise BackendError(f"{spec.model}: unknown dtype {spec.dtype!r} (allowed: auto, float32, bfloat16, float16)")
        # A broken local folder gets a one-line error naming the file before transformers tries it.
        check_model_dir(spec.model)
        for name, path in spec.adapters.items():
            check_adapter_dir(name, path)
        kw: dict[str, Any] = {"revision": spec.revision, "trust_remote_code": spec.trust_remote_code}
        try:
            tokenizer = AutoTokenizer.from_pretrained(spec.model, **kw)
            if device.startswith("cuda"):  # load straight onto the GPU
                kw["device_map"] = device
            model = AutoModelForCausalLM.from_pretrained(spec.model, dtype=dtype, **kw)
        except Exception as e:  # noqa: BLE001 - loaders raise many types (SafetensorError is not an OSError)
            raise BackendError(f"cannot load model {spec.model}: {type(e).__name__}: {one_line(e)}") from e
        model.to(device)
        model.eval()
        if spec.adapters:
            from peft import PeftModel

            items = list(spec.adapters.items())
            try:
                name, path = items[0]
                model = PeftModel.from_pretrained(model, path, adapter_name=name, is_trainable=False)
                for name, path in items[1:]:
                    model.load_adapter(path, adapter_name=name, is_trainable=False)
            except Exception as e:  # noqa: BLE001 - as above
                raise BackendError(f"cannot load LoRA adapter {name!r} from {path}: {type(e).__name__}: "
                                   f"{one_line(e)}") from e
            model.to(device)
            model.eval()
        return cls(spec, model, tokenizer, device, dtype)

    def _base_model(self) -> Any:
        m = self.model
        if hasattr(m, "get_base_model") and getattr(self.spec, "adapters", None):
            return m.get_base_model()
        return m

    # ------------------------------------------------------------------ tokens
    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Prompt token ids: the chat template with the assistant generation prompt. The last
        `_ENCODE_CACHE_SIZE` results are kept: callers count a prompt's tokens (`count_tokens`)
        and then submit the same messages, and tokenising an 8k-token prompt takes ~10 ms on the
        event loop."""
        import numpy as np

        try:
            key: Any = tuple(tuple(sorted(m.items())) for m in messages)
            hash(key)
        except (AttributeError, TypeError):  # unusual message values: no caching
            key = None
        with self._tok_lock:
            hit = self._encoded.get(key) if key is not None else None
            if hit is not None:
                self._encoded.move_to_end(key)
                return hit.tolist()
            ids = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False)
            if ids and isinstance(ids[0], list):
                ids = ids[0]
            ids = [int(i) for i in ids]
            if key is not None:
                self._encoded[key] = np.array(ids, dtype=np.int64)
                while len(self._encoded) > _ENCODE_CACHE_SIZE:
                    self._encoded.popitem(last=False)
        return ids

    def count_tokens(self, messages: list[dict[str, str]]) -> int:
        return len(self.encode_chat(messages))

    def decode(self, ids: list[int]) -> str:
        with self._tok_lock:
            return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    # ------------------------------------------------------------------ grammars
    @property
    def vocab_type(self) -> Any:
        """xgrammar's detected vocabulary type (BYTE_LEVEL for byte-level BPE tokenizers)."""
        self._ensure_xgrammar()
        return self._xgr_info.vocab_type

    @property
    def closer(self) -> _Closer:
        self._ensure_xgrammar()
        assert self._closer is not None
        return self._closer

    def _ensure_xgrammar(self) -> None:
        with self._grammar_lock:
            if self._xgr_info is not None:
                return
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_ids)
            self._compiler = xgr.GrammarCompiler(info)
            self._closer = _Closer(info, self.stop_ids, self.special_ids, self.vocab_size)
            self._xgr_info = info

    def grammar_for(self, schema: dict[str, Any]) -> _Grammar:
        """Compiled grammar (and its start-state closing path) for a JSON schema, cached by the
        schema's canonical JSON. Raises ValueError for schemas xgrammar rejects."""
        import xgrammar as xgr

        key = json.dumps(schema, separators=(",", ":"))  # key order kept: it is the output order
        with self._grammar_lock:
            hit = self._grammars.get(key)
        if hit is not None:
            return hit
        self._ensure_xgrammar()
        try:
            compiled = self._compiler.compile_json_schema(key, any_whitespace=False)
        except Exception as e:  # xgrammar raises RuntimeError/ValueError subclasses
            raise ValueError(f"JSON schema not supported by xgrammar: {e}") from e
        start = xgr.GrammarMatcher(compiled, override_stop_tokens=self.stop_ids)
        path = self.closer.path(start, cap=1 << 16)
        grammar = _Grammar(compiled, path)
        with self._grammar_lock:
            self._grammars.setdefault(key, grammar)
            return self._grammars[key]

    # ------------------------------------------------------------------ public API
    async def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        if not requests:
            return []
        futures = [await self._submit(r) for r in requests]
        return list(await asyncio.gather(*futures))

    def describe(self) -> dict[str, Any]:
        import torch
        import transformers

        from importlib.metadata import PackageNotFoundError, version

        try:
            xgr_version = version("xgrammar")
        except PackageNotFoundError:  # pragma: no cover
            xgr_version = None
        cfg = self._base_model().config
        cfg_file = Path(self.spec.model) / "config.json"
        cfg_text = cfg_file.read_bytes() if cfg_file.is_file() else cfg.to_json_string().encode()
        return {
            "backend": "hf",
            "model": self.spec.model,
            "model_path": str(Path(self.spec.model).resolve()) if Path(self.spec.model).exists() else self.spec.model,
            "revision": self.spec.revision or getattr(cfg, "_commit_hash", None),
            "dtype": str(self.dtype).replace("torch.", ""),
            "device": self.device,
            "architectures": getattr(cfg, "architectures", None),
            "vocab_size": self.vocab_size,
            "max_model_len": self.max_model_len,
            "adapters": dict(self.spec.adapters),
            "max_batch_size": self.spec.max_batch_size,
            "batch_wait_ms": self.spec.batch_wait_ms,
            "prefix_cache_gib": self.spec.prefix_cache_gib if self.spec.enable_prefix_caching else 0,
            "config_sha256": hashlib.sha256(cfg_text).hexdigest(),
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "xgrammar": xgr_version,
        }

    async def aclose(self) -> None:
        self._closed = True
        worker = self._worker
        if self._wakeup is not None:
            self._wakeup.set()
        if worker is not None and not worker.done():
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # pragma: no cover
                loop = None
            if loop is self._loop:
                try:
                    await asyncio.wait_for(asyncio.shield(worker), timeout=1.0)
                except (asyncio.TimeoutError, asyncio.CancelledError):
                    worker.cancel()
            else:
                worker.cancel()
        self._fail_queued("backend closed")
        self._fail_rows(self._inflight, "backend closed during generation")
        self._worker = None
        if self._run_lock.acquire(blocking=False):  # free the cached keys/values unless a batch
            try:                                     # still runs (then they go with the backend)
                self.prefix_cache.clear()
            finally:
                self._run_lock.release()

    # ------------------------------------------------------------------ queue and worker
    def _error_result(self, pending_t0: float, error: str, prompt_ids: list[int] | None = None) -> GenerationResult:
        return GenerationResult(
            completions=[], prompt_tokens=len(prompt_ids or []), latency_s=time.perf_counter() - pending_t0,
            model_id=self.model_id, error=error, prompt_token_ids=prompt_ids)

    def _adapter_name(self, adapter: str | None) -> str | None:
        if adapter is None:
            return None
        if adapter in self.spec.adapters:
            return adapter
        for name, path in self.spec.adapters.items():
            if adapter == path or Path(adapter).resolve() == Path(path).resolve():
                return name
        raise KeyError(adapter)

    async def _submit(self, req: GenerationRequest) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        t0 = time.perf_counter()

        def fail(msg: str, prompt_ids: list[int] | None = None) -> asyncio.Future:
            fut.set_result(self._error_result(t0, msg, prompt_ids))
            return fut

        if self._closed:
            return fail("backend closed")
        s = req.sampling
        if s.n < 1 or s.max_tokens < 1:
            return fail(f"invalid sampling params: n={s.n}, max_tokens={s.max_tokens} (both must be >= 1)")
        if s.temperature < 0 or not (0 < s.top_p <= 1):
            return fail(f"invalid sampling params: temperature={s.temperature} (>= 0), top_p={s.top_p} (0 < p <= 1)")
        try:
            adapter = self._adapter_name(req.adapter)
        except KeyError:
            known = ", ".join(sorted(self.spec.adapters)) or "none configured"
            return fail(f"unknown adapter {req.adapter!r} (known: {known})")
        try:
            prompt_ids = self.encode_chat(req.messages)
        except Exception as e:  # template errors: bad roles, missing content, ...
            return fail(f"chat template failed: {type(e).__name__}: {e}")
        if len(prompt_ids) >= self.max_model_len:
            return fail(f"prompt too long: {len(prompt_ids)} tokens, but the model's max length is "
                        f"{self.max_model_len} tokens (max_model_len / max_position_embeddings)", prompt_ids)
        grammar = None
        if req.json_schema is not None:
            try:
                grammar = self._grammars.get(json.dumps(req.json_schema, separators=(",", ":")))
                if grammar is None:  # compile off the event loop
                    grammar = await asyncio.to_thread(self.grammar_for, req.json_schema)
            except (TypeError, ValueError) as e:
                return fail(str(e), prompt_ids)
        max_tokens = min(s.max_tokens, self.max_model_len - len(prompt_ids))
        pending = _Pending(req, fut, t0, prompt_ids, [None] * s.n, s.n)
        self._ensure_worker(loop)
        for j in range(s.n):
            self._queue.append(_Row(
                pending=pending, j=j, prompt_ids=prompt_ids, max_tokens=max_tokens,
                temperature=float(s.temperature), top_p=float(s.top_p), seed=_row_seed(s.seed, j),
                grammar=grammar, adapter=adapter))
        assert self._wakeup is not None
        self._wakeup.set()
        return fut

    def _ensure_worker(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._loop is not loop or self._worker is None or self._worker.done():
            if self._loop is not loop:  # rows of a finished loop can never be delivered
                self._queue = collections.deque()
                self._inflight = []
            self._loop = loop
            self._wakeup = asyncio.Event()
            self._worker = loop.create_task(self._work(), name="hf-backend-worker")

    def _take_batch(self) -> list[_Row]:
        first = self._queue[0]
        batch: list[_Row] = []
        keep: collections.deque[_Row] = collections.deque()
        while self._queue:
            r = self._queue.popleft()
            if len(batch) < self.spec.max_batch_size and r.adapter == first.adapter:
                batch.append(r)
            else:
                keep.append(r)
        self._queue = keep
        return batch

    async def _work(self) -> None:
        assert self._wakeup is not None
        wakeup = self._wakeup
        wait_s = self.spec.batch_wait_ms / 1000.0
        while not self._closed:
            if not self._queue:
                wakeup.clear()
                await wakeup.wait()
                continue
            if len(self._queue) < self.spec.max_batch_size and wait_s > 0:
                deadline = time.perf_counter() + wait_s
                while len(self._queue) < self.spec.max_batch_size and not self._closed:
                    left = deadline - time.perf_counter()
                    if left <= 0:
                        break
                    wakeup.clear()
                    try:
                        await asyncio.wait_for(wakeup.wait(), timeout=left)
                    except asyncio.TimeoutError:
                        break
            if self._closed or not self._queue:
                continue
            batch = self._take_batch()
            self._inflight = batch
            try:
                error = await asyncio.to_thread(self._run_batch, batch)
            except Exception as e:  # never let one bad batch kill the worker
                log.exception("hf backend batch failed")
                error = f"generation failed: {type(e).__name__}: {e}"
            self._deliver(batch, error)
            self._inflight = []
        self._fail_queued("backend closed")

    def _deliver(self, batch: list[_Row], error: str | None) -> None:
        for r in batch:
            p = r.pending
            if p.future.done():
                continue
            if error is not None:
                p.future.set_result(self._error_result(p.t0, error, p.prompt_ids))
                continue
            p.completions[r.j] = Completion(text=self.decode(r.tokens), token_ids=list(r.tokens),
                                            finish_reason=r.finish or "length")
            p.remaining -= 1
            if p.remaining == 0:
                comps = [c for c in p.completions if c is not None]
                p.future.set_result(GenerationResult(
                    completions=comps, prompt_tokens=len(p.prompt_ids),
                    completion_tokens=sum(len(c.token_ids or []) for c in comps),
                    cached_tokens=p.cached_tokens, latency_s=time.perf_counter() - p.t0, model_id=self.model_id,
                    prompt_token_ids=list(p.prompt_ids)))

    def _fail_queued(self, msg: str) -> None:
        rows, self._queue = list(self._queue), collections.deque()
        self._fail_rows(rows, msg)

    def _fail_rows(self, rows: list[_Row], msg: str) -> None:
        for r in rows:
            if not r.pending.future.done() and not r.pending.future.get_loop().is_closed():
                r.pending.future.set_result(self._error_result(r.pending.t0, msg, r.pending.prompt_ids))

    # ------------------------------------------------------------------ one batched decode
    def _run_batch(self, rows: list[_Row]) -> str | None:
        """Decode `rows` together (in a worker thread). Fills each row's tokens and finish."""
        t_start = time.perf_counter()
        try:
            return self._decode(rows)
        finally:
            self.busy_s += time.perf_counter() - t_start

    def _decode(self, rows: list[_Row]) -> str | None:
        import torch

        with self._run_lock:
            if any(r.grammar is not None for r in rows):
                self._ensure_xgrammar()
            sampler = _RowSampler(self, rows)
            adapter = rows[0].adapter
            ctx: Any = contextlib.nullcontext()
            if self.spec.adapters:
                if adapter is None:
                    ctx = self.model.disable_adapter()
                else:
                    self.model.set_adapter(adapter)
            with torch.inference_mode(), ctx:
                if self._own_loop:
                    steps = self._decode_loop(rows, sampler)
                else:
                    steps = self._decode_generate(rows, sampler)
            self.batches_run += 1
            st = self.stats
            st["batches"] += 1
            st["rows"] += len(rows)
            st["max_batch_rows"] = max(st["max_batch_rows"], len(rows))
            st["decode_steps"] += steps
            st["json_rows"] += sum(r.grammar is not None for r in rows)
            st["json_rejections"] += sampler.rejections
        return "backend closed during generation" if sampler.interrupted else None

    def _decode_loop(self, rows: list[_Row], sampler: _RowSampler) -> int:
        """Our own decode loop (see module doc); returns the number of decode steps.

        1. Prefill: every distinct prompt alone (batch 1, no padding, no mask: the causal fast
           path), into a DynamicCache; its keys/values are copied into the batched buffers,
           left-padded to the longest prompt (rows of an n>1 request share the prefill).
        2. Decode: one forward per step for the rows still running, with a padding mask and
           per-row position ids continuing each row's own length; the sampler picks the tokens.
        3. Rows that finish are dropped from the batch (and leading columns that are padding for
           every remaining row) once they are `_COMPACT_FRACTION` of it."""
        import torch
        from transformers import DynamicCache

        model, dev = self.model, self.device
        adapter = rows[0].adapter
        n = len(rows)
        lens = [len(r.prompt_ids) for r in rows]
        width = max(lens)
        capacity = width + min(max(r.max_tokens for r in rows), _CAPACITY_STEP) + 1
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, r in enumerate(rows):
            groups.setdefault(tuple(r.prompt_ids), []).append(i)
        first: list[Any] = [None] * n
        bufs: list[tuple[Any, Any]] = []
        for prompt, members in groups.items():
            if self._closed:  # aclose() during a long prefill
                sampler.interrupted = True
                for r in rows:
                    r.finish = "length"
                return 0
            t0 = time.perf_counter()
            pre = DynamicCache()
            reused, past = self.prefix_cache.lookup(adapter, prompt, limit=len(prompt) - 1)
            if reused and self.device == "cpu" and len(prompt) - reused > _CPU_REUSE_MAX_NEW_PER_CACHED * reused:
                reused, past = 0, None
                self.stats["prefix_matches_ignored"] += 1
            for li, (k, v) in enumerate(past or []):
                pre.update(k, v, li)
            rows[members[0]].pending.cached_tokens = reused
            out = model(input_ids=torch.tensor([prompt[reused:]], dtype=torch.long, device=dev), cache=pre,
                        use_cache=True, logits_to_keep=1)
            self.stats["prefill_tokens"] += len(prompt) - reused
            self.stats["prefix_reused_tokens"] += reused
            self.prefix_cache.insert(adapter, prompt, [(layer.keys, layer.values) for layer in pre.layers])
            lo = width - len(prompt)
            for li, layer in enumerate(pre.layers):
                k, v = layer.keys, layer.values
                if li == len(bufs):  # zeros: masked padding must not hold NaNs (0 * NaN in attention)
                    bufs.append((k.new_zeros((n, k.shape[1], capacity, k.shape[3])),
                                 v.new_zeros((n, v.shape[1], capacity, v.shape[3]))))
                for i in members:
                    bufs[li][0][i, :, lo:width] = k[0]
                    bufs[li][1][i, :, lo:width] = v[0]
            logits = out.logits[0, -1]
            for i in members:
                first[i] = logits
            del pre, out
            self.timings["prefill_s"] += time.perf_counter() - t0
        layer_cls = _buffer_layer_class()
        cache = DynamicCache()
        cache.layers = [layer_cls(kb, vb, width) for kb, vb in bufs]
        mask = torch.zeros((n, capacity), dtype=torch.bool)
        for i, m in enumerate(lens):
            mask[i, width - m:width] = True
        mask = mask.to(dev)
        position = torch.tensor(lens, dtype=torch.long, device=dev).unsqueeze(1)  # of the next token fed
        active = list(range(n))  # batch position -> row index
        pad_start = [width - m for m in lens]  # per row: its first real column
        length = width  # columns filled
        scores = torch.stack(first)
        del first
        steps = 0
        timings = self.timings
        while True:
            t0 = time.perf_counter()
            feed = sampler.step(scores, active, steps)
            timings["sample_s"] += time.perf_counter() - t0
            steps += 1
            sampler.expire(steps)
            live = [p for p, a in enumerate(active) if rows[a].finish is None]
            if not live:
                self._remember(rows, cache, active, range(len(active)), pad_start, length)
                return steps
            if len(active) - len(live) >= max(1.0, _COMPACT_FRACTION * len(active)):
                done = [p for p, a in enumerate(active) if rows[a].finish is not None]
                self._remember(rows, cache, active, done, pad_start, length)
                start = min(pad_start[active[p]] for p in live)
                index = torch.tensor(live, dtype=torch.long, device=dev)
                for layer in cache.layers:
                    layer.keep(index, start)
                mask, position = mask[index, start:], position[index]
                active, feed = [active[p] for p in live], [feed[p] for p in live]
                for a in active:
                    pad_start[a] -= start
                length -= start
            if length >= mask.shape[1]:
                mask = torch.cat([mask, mask.new_zeros((mask.shape[0], _CAPACITY_STEP))], dim=1)
                for layer in cache.layers:
                    layer.reserve(length + _CAPACITY_STEP)
            mask[:, length] = True
            length += 1
            t0 = time.perf_counter()
            out = model(input_ids=torch.tensor(feed, dtype=torch.long, device=dev).unsqueeze(1),
                        attention_mask=mask[:, :length], position_ids=position, cache=cache, use_cache=True)
            position += 1
            scores = out.logits[:, -1]
            timings["forward_s"] += time.perf_counter() - t0

    def _remember(self, rows: list[_Row], cache: Any, active: list[int], positions: Any,
                  pad_start: list[int], length: int) -> None:
        """Put the keys/values of finished rows (prompt plus the generated tokens fed so far) in
        the prefix cache: the next prompt of a conversation usually continues this answer. Only
        for n=1 requests (best-of-n siblings are rarely continued; their prompt is cached)."""
        if self.prefix_cache.max_bytes == 0:
            return
        for p in positions:
            r = rows[active[p]]
            if r.pending.request.sampling.n != 1:
                continue
            start = pad_start[active[p]]
            fed = min(length - start - len(r.prompt_ids), len(r.tokens))
            if fed <= 0:
                continue
            end = start + len(r.prompt_ids) + fed
            kv = [(layer.kbuf[p:p + 1, :, start:end].clone(), layer.vbuf[p:p + 1, :, start:end].clone())
                  for layer in cache.layers]
            self.prefix_cache.insert(r.adapter, list(r.prompt_ids) + r.tokens[:fed], kv)

    def _decode_generate(self, rows: list[_Row], sampler: _RowSampler) -> int:
        """Fallback for models whose cache is not plain full attention (sliding-window, linear
        attention layers): one left-padded `model.generate` with the sampler as its logits
        processor. Returns the number of decode steps."""
        import torch
        from transformers import GenerationConfig, LogitsProcessorList

        width = max(len(r.prompt_ids) for r in rows)
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            n = len(r.prompt_ids)
            input_ids[i, width - n:] = torch.tensor(r.prompt_ids, dtype=torch.long)
            attention[i, width - n:] = 1
        sampler.prompt_width = width
        gen_cfg = GenerationConfig(
            max_new_tokens=max(r.max_tokens for r in rows), do_sample=False, num_beams=1,
            eos_token_id=self.stop_ids, pad_token_id=self.pad_id)
        out = self.model.generate(
            input_ids=input_ids.to(self.device), attention_mask=attention.to(self.device),
            generation_config=gen_cfg, logits_processor=LogitsProcessorList([sampler]))
        return int(out.shape[1] - width)
