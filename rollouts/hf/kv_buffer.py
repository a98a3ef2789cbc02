"""The batched cache of our decode loop (`rollouts/hf/decode.py`): one `BufferLayer` per model
layer, a transformers `DynamicLayer` over preallocated [B, H, capacity, D] key and value buffers.
transformers is imported at module level: the `rollouts.hf` package is itself imported only when
an `hf` backend is built (`rollouts/backends.py`)."""
from __future__ import annotations

from typing import Any

from transformers.cache_utils import DynamicLayer


class BufferLayer(DynamicLayer):
    """One layer of the batched decode cache. A decode step writes its column into the
    buffers (DynamicLayer re-concatenates the whole cache every step); `keys`/`values` are
    views of the filled part. Rows are left-padded: row i's prompt ends at the same column
    for every row, and the attention mask hides the padding."""

    def __init__(self, kbuf: Any, vbuf: Any, length: int):
        super().__init__()  # type: ignore[no-untyped-call]  # transformers leaves DynamicLayer.__init__ unannotated
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
