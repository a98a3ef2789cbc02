"""Keys/values of earlier sequences, reused across requests by the in-process `hf` backend: what
a vLLM server's automatic prefix caching does, for the backend that has none.

`lookup` returns the longest common token prefix with any entry (keys/values of position i depend
only on tokens 0..i, so it is exactly reusable); entries are separated by LoRA adapter, bounded by
`max_bytes` (least recently used out, a prefix of a newer entry dropped for it), and used from the
decode thread only, so no locking. Why and how: docs/benchmark.md, "Inside the `hf` backend"."""
from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

KV = list[tuple[Any, Any]]  # per layer: (keys, values), each [1, heads, length, head_dim]


@dataclass
class _Entry:
    adapter: str | None
    ids: np.ndarray
    layers: KV
    nbytes: int


def common_prefix(a: np.ndarray, b: np.ndarray, chunk: int = 256) -> int:
    """Length of the longest common prefix of two int arrays. Compared in growing chunks: most
    cached sequences share only a system prompt with a query, and stop matching early."""
    m = min(len(a), len(b))
    start = 0
    while start < m:
        end = min(m, start + chunk)
        differ = np.flatnonzero(a[start:end] != b[start:end])
        if len(differ):
            return start + int(differ[0])
        start, chunk = end, chunk * 4
    return m


class PrefixCache:
    """LRU store of per-sequence keys/values with longest-common-prefix lookup (see module doc)."""

    def __init__(self, max_bytes: int, min_match: int = 16):
        if max_bytes < 0:
            raise ValueError(f"prefix cache: max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = int(max_bytes)
        self.min_match = min_match  # shorter matches are not worth a cache round trip
        self._entries: collections.OrderedDict[int, _Entry] = collections.OrderedDict()
        self._next_key = 0
        self.nbytes = 0
        self.stats: dict[str, int] = collections.Counter(lookups=0, hits=0, hit_tokens=0, inserts=0, evictions=0)

    @property
    def tokens(self) -> int:
        return sum(len(e.ids) for e in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, adapter: str | None, ids: Sequence[int], limit: int) -> tuple[int, KV | None]:
        """The longest cached prefix of `ids` (at most `limit` tokens) for `adapter`: its length and
        per-layer key/value views sliced to it, or (0, None) below `min_match` tokens."""
        self.stats["lookups"] += 1
        if not self._entries or limit < self.min_match:
            return 0, None
        query = np.asarray(ids, dtype=np.int64)
        best_key, best = None, 0
        for key, e in self._entries.items():
            if e.adapter == adapter and (n := common_prefix(query, e.ids)) > best:
                best_key, best = key, n
        best = min(best, limit)
        if best_key is None or best < self.min_match:
            return 0, None
        self._entries.move_to_end(best_key)
        self.stats["hits"] += 1
        self.stats["hit_tokens"] += best
        layers = self._entries[best_key].layers
        return best, [(k[:, :, :best], v[:, :, :best]) for k, v in layers]

    def insert(self, adapter: str | None, ids: Sequence[int], layers: KV) -> None:
        """Remember `layers` (keys/values of all of `ids`; the cache keeps these tensors, so they
        must not be views of buffers that are written later)."""
        nbytes = sum(k.nbytes + v.nbytes for k, v in layers)
        if len(ids) < self.min_match or nbytes > self.max_bytes:
            return
        new = np.asarray(ids, dtype=np.int64)
        for key, e in list(self._entries.items()):
            if e.adapter != adapter:
                continue
            n = common_prefix(new, e.ids)
            if n == len(new):  # already covered by a longer (or equal) entry
                self._entries.move_to_end(key)
                return
            if n == len(e.ids):  # the old entry is a prefix of the new one
                self._drop(key)
        self._entries[self._next_key] = _Entry(adapter, new, layers, nbytes)
        self._next_key += 1
        self.nbytes += nbytes
        self.stats["inserts"] += 1
        while self.nbytes > self.max_bytes:
            self._drop(next(iter(self._entries)))
            self.stats["evictions"] += 1

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0

    def _drop(self, key: int) -> None:
        self.nbytes -= self._entries.pop(key).nbytes
