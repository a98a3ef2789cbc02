"""The lens fit's running sums: two fp32 sums in host memory (even / odd prompts), one prompt's
estimate added at a time, with the convergence bookkeeping (Δ of the mean, the deepest layer's
distance from the identity) and the early-stop rule.

Why host memory: for an 8B model the sums are 2 x 31 x 4096² x 4 B = 4.2 GB that the GPU needs for
activations. Why a worker thread on CUDA (issue 30, B7): adding one prompt makes ~15 passes over
31 x 67 MB of host memory, ~1.5-4 s during which the GPU would otherwise wait. `Accumulator` starts
the estimate's copy to a pinned buffer on the GPU's stream and adds it in a worker thread while the
main thread already runs the next prompt's backward passes. The result is the serial one exactly:
prompts are added in order, by one thread, and the early stop is decided on the same history (a
prompt computed after the stop was due is dropped, not added).
"""
from __future__ import annotations

import math
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

SUMS_DEVICE = torch.device("cpu")  # where the running sums live (docs/lens.md, "What is computed")


def _identity_distance(M: torch.Tensor) -> float:
    d = M.shape[-1]
    if M.shape[-2] != d:
        return float("nan")
    eye = torch.eye(d, dtype=M.dtype, device=M.device)
    return float(torch.linalg.matrix_norm(M - eye) / math.sqrt(d))


class _State:
    """Running sums (host memory, fp32) and bookkeeping; what a checkpoint holds."""

    def __init__(self, n_src: int, k: int, d: int):
        self.sum_a = torch.zeros(n_src, k, d, dtype=torch.float32, device=SUMS_DEVICE)
        self.sum_b = torch.zeros_like(self.sum_a)
        self.n_a = 0
        self.n_b = 0
        self.next_idx = 0
        self.skipped: list[int] = []
        self.history: list[dict[str, Any]] = []
        self.stopped_early = False

    @property
    def n(self) -> int:
        return self.n_a + self.n_b

    def to_dict(self) -> dict:
        import json

        return {
            "sum_a": self.sum_a.cpu(),
            "sum_b": self.sum_b.cpu(),
            "n_a": self.n_a,
            "n_b": self.n_b,
            "next_idx": self.next_idx,
            "skipped": self.skipped,
            "history": json.dumps(self.history),
            "stopped_early": self.stopped_early,
        }

    @classmethod
    def from_dict(cls, obj: dict) -> _State:
        import json

        st = cls(1, 1, 1)
        st.sum_a = obj["sum_a"].to(SUMS_DEVICE, torch.float32)
        st.sum_b = obj["sum_b"].to(SUMS_DEVICE, torch.float32)
        st.n_a, st.n_b = int(obj["n_a"]), int(obj["n_b"])
        st.next_idx = int(obj["next_idx"])
        st.skipped = list(obj["skipped"])
        st.history = json.loads(obj["history"])
        st.stopped_early = bool(obj["stopped_early"])
        return st


def _accumulate(state: _State, Jp: torch.Tensor, idx: int, n_tokens: int, seconds: float) -> None:
    """Add one prompt's estimate (in host memory) to its half; Δ per layer = ||M_new − M_old||_F / ||M_new||_F.

    Works one layer at a time so the temporaries stay one `k×d` matrix, with as few passes over it
    as the bookkeeping allows (host memory bandwidth is the cost: 31 layers of 67 MB for an 8B)."""
    n_old = state.n
    target_sum = state.sum_a if n_old % 2 == 0 else state.sum_b
    other_sum = state.sum_b if n_old % 2 == 0 else state.sum_a
    rel, id_deepest = [], float("nan")
    for i in range(Jp.shape[0]):
        total = torch.add(target_sum[i], other_sum[i])
        if n_old > 0:  # ||J_p − M_old|| / (n+1) = ||M_new − M_old||
            diff = torch.linalg.matrix_norm(torch.add(Jp[i], total, alpha=-1.0 / n_old)) / (n_old + 1)
        total.add_(Jp[i])  # now n_old + 1 times the new mean
        if n_old > 0:
            rel.append(float(diff / (torch.linalg.matrix_norm(total) / (n_old + 1)).clamp_min(1e-30)))
        if i == Jp.shape[0] - 1:
            id_deepest = _identity_distance(total.div_(n_old + 1))
        target_sum[i] += Jp[i]
    if n_old % 2 == 0:
        state.n_a += 1
    else:
        state.n_b += 1
    jnorm = float(torch.linalg.matrix_norm(Jp).max() / math.sqrt(Jp.shape[-1]))
    state.history.append({
        "prompt_index": idx,
        "n": state.n,
        "n_tokens": n_tokens,
        "delta_mean": sum(rel) / len(rel) if rel else float("nan"),
        "delta_max": max(rel) if rel else float("nan"),
        "jnorm_max": jnorm,
        "identity_distance_deepest": id_deepest,
        "seconds": seconds,
    })


def stop_due(state: _State, stop_at_delta: float, min_prompts: int) -> bool:
    """The early-stop rule: at least `min_prompts` done and the mean Δ of the last 10 below the bar."""
    if stop_at_delta <= 0 or state.n < min_prompts:
        return False
    recent = [h["delta_mean"] for h in state.history[-10:]]
    return len(recent) == 10 and sum(recent) / 10 < stop_at_delta


class Accumulator:
    """Adds the per-prompt estimates to `state`, in order. With `overlap` (the default on CUDA) the
    addition runs in one worker thread while the caller computes the next prompt; `add` returns
    False, dropping the estimate, when the prompts already added make the early stop due.

    Use: `add` per prompt, `wait` before reading or saving the state, `close` at the end."""

    def __init__(self, state: _State, stop_at_delta: float = 0.0, min_prompts: int = 0, overlap: bool = False):
        self.state, self.stop_at_delta, self.min_prompts = state, stop_at_delta, min_prompts
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="lens-sums") if overlap else None
        self._pending: Future[None] | None = None
        self._buffers: list[torch.Tensor | None] = [None, None]  # pinned copies, alternating
        self._in_use: list[Future[None] | None] = [None, None]
        self._slot = 0

    def _check_stop(self) -> None:
        if not self.state.stopped_early and stop_due(self.state, self.stop_at_delta, self.min_prompts):
            self.state.stopped_early = True

    def add(self, Jp: torch.Tensor, idx: int, n_tokens: int, seconds: float) -> bool:
        if self._pool is None:
            _accumulate(self.state, Jp.to(SUMS_DEVICE), idx, n_tokens, seconds)
            self._check_stop()
            return True
        slot = self._slot
        self._slot = 1 - slot
        if self._in_use[slot] is not None:  # the prompt two back used this buffer: long done
            self._in_use[slot].result()  # type: ignore[union-attr]
        host = self._buffers[slot]
        if host is None or host.shape != Jp.shape:
            host = torch.empty(Jp.shape, dtype=torch.float32, pin_memory=Jp.device.type == "cuda")
            self._buffers[slot] = host
        ready: Any = None
        if Jp.device.type == "cuda":
            stream = torch.cuda.current_stream(Jp.device)  # the copy runs there, after the backward passes
            host.copy_(Jp, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(stream)
        else:
            host.copy_(Jp)
        self.wait()  # the previous prompt is added (it had the whole of this prompt's GPU time)
        if self.state.stopped_early:
            return False
        self._pending = self._in_use[slot] = self._pool.submit(self._work, host, ready, idx, n_tokens, seconds)
        return True

    def _work(self, host: torch.Tensor, ready: Any, idx: int, n_tokens: int, seconds: float) -> None:
        if ready is not None:
            ready.synchronize()
        _accumulate(self.state, host, idx, n_tokens, seconds)

    def wait(self) -> None:
        """Until every estimate given to `add` is in the sums (re-raising a failure there); then the
        early-stop rule is applied to the history so far."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()
        self._check_stop()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
