"""JSON termination guarantee for rows with a `json_schema`: the grammar is compiled with
`any_whitespace=False` and applied as a token bitmask (special tokens other than the stop
tokens are masked too). xgrammar 0.2.9 does enforce `maxLength`, `maxItems` and numeric
`minimum`/`maximum`, but a schema's total length can still exceed the token budget, and plain
strings are unbounded. So each constrained row also carries a *closing path*: an explicit token
sequence that takes the grammar from the current state to termination (stop token included),
found by a deterministic policy (`Closer.path`: forced jump-forward tokens; else the stop token
when the JSON is complete; else the first allowed of `" ] } , 0-9 …` single-byte tokens; else the
first allowed token). Invariant: len(closing path) <= tokens left. After the row samples a
token, the old path is re-verified from the new state (`accept_token` only, cheap) or a new one
is searched (`guard`); if no path fits in the remaining budget the sampled token is rejected and
the next token of the current path is emitted instead; once the path length equals the budget
the row follows it (`RowSampler.step`). The output therefore always terminates with a complete
JSON document and finish_reason "stop", as long as the schema's shortest document (by the
policy) fits in `max_tokens` (otherwise the row decodes unguarded and may end with "length";
`stats["json_unguarded_rows"]` counts those). The policy can loop on string `pattern`s it cannot
satisfy with ASCII; the search is capped by the budget, so that also only drops the guarantee.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import xgrammar as xgr

if TYPE_CHECKING:
    from rollouts.hf.rows import Row

# Single characters the closing policy tries, in order: close strings, close containers, end a
# value, digits for numbers, then any printable ASCII (enum/keys/patterns/booleans).
_CLOSE_PRIORITY = '"]},0123456789' + "".join(
    c for c in (chr(i) for i in range(0x20, 0x7F)) if c not in '"]},0123456789')


class Closer:
    """Finds closing paths for one tokenizer: token sequences that drive a GrammarMatcher to
    termination. Only used from the decode thread."""

    def __init__(self, info: Any, stop_ids: list[int], special_ids: set[int], vocab_size: int):
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
        self._local = threading.local()  # one scratch bitmask per thread

    def _mask(self, matcher: Any, slot: str) -> Any:
        scratch = getattr(self._local, slot, None)
        if scratch is None:
            scratch = xgr.allocate_token_bitmask(1, self.vocab_size)
            setattr(self._local, slot, scratch)
        matcher.fill_next_token_bitmask(scratch, 0)
        return scratch[0].numpy()

    @staticmethod
    def _allowed(words: Any, tok: int) -> bool:
        return tok >= 0 and bool((int(words[tok >> 5]) >> (tok & 31)) & 1)

    def _choose(self, matcher: Any) -> int | None:
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
class Grammar:
    compiled: Any
    initial_path: list[int] | None  # closing path from the start state (None: none found)



def guard(closer: Closer, r: Row, tok: int, left: int) -> tuple[int, bool]:
    """The token to emit for constrained row `r` with `left` tokens of budget (this one
    included), and whether the sampled `tok` was rejected; updates r.path so that
    len(r.path) <= left - 1 afterwards."""
    if r.path is None:  # unguarded row
        return tok, False
    if r.path and tok == r.path[0]:
        r.path = r.path[1:]
        return tok, False
    after = r.matcher.fork()
    new_path = None
    if after.accept_token(tok):
        if len(r.path) <= left - 1 and closer.verify(after, r.path):
            new_path = r.path
        else:
            new_path = closer.path(after, cap=left - 1)
    if new_path is None:  # the sample cannot be closed within budget: follow the path instead
        tok, r.path = r.path[0], r.path[1:]
        return tok, True
    r.path = new_path
    return tok, False
