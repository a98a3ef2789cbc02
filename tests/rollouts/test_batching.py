"""When the hf backend starts a batch (rollouts/hf/batching.py; issue 30, item 6).

The rollout engine sends a trial's next request a few milliseconds after its answer arrives (it
parses, writes the row, builds and counts the next prompt). With a fixed wait from the first arrival,
the next batch started with the first trials only and the others waited a whole batch: more batches
and more decode steps than the same requests sent together. After a batch the worker now waits for as
many rows as it answered, for at most a share of its duration."""
from __future__ import annotations

import asyncio
import time

import pytest

from rollouts.hf import HFBackend
from rollouts.hf.batching import FOLLOW_SHARE, BatchFill
from rollouts.hf.spec import HFSpec
from rollouts.types import GenerationRequest, SamplingParams


def _backend(path) -> HFBackend:
    b = HFBackend.from_spec(HFSpec(model=str(path), batch_wait_ms=2, max_batch_size=16,
                                      enable_prefix_caching=False))
    b.stop_set = set()  # every row decodes exactly max_tokens: rounds take the same time
    return b


def _engine_like(backend: HFBackend, chains: int, rounds: int, gaps_ms: list[float]) -> None:
    """`chains` clients; each sends a request, and `gaps_ms[i]` after its answer the next one (the
    engine's work between two calls of a trial), `rounds` times."""

    async def chain(i: int) -> None:
        for r in range(rounds):
            req = GenerationRequest([{"role": "user", "content": f"trial {i} round {r}: status?"}],
                                    SamplingParams(temperature=1.0, max_tokens=48, seed=i))
            [res] = await backend.generate([req])
            assert res.ok, res.error
            await asyncio.sleep(gaps_ms[i] / 1000)

    async def go():
        try:
            await asyncio.gather(*(chain(i) for i in range(chains)))
        finally:
            await backend.aclose()

    asyncio.run(go())


def test_the_senders_of_the_last_batch_make_the_next_one(tiny_llama_dir):
    together = _backend(tiny_llama_dir)
    _engine_like(together, 4, 3, [0, 0, 0, 0])
    assert together.stats["batches"] == 3  # the same requests sent at once: one batch per round
    staggered = _backend(tiny_llama_dir)
    _engine_like(staggered, 4, 3, [0, 3, 6, 9])  # the engine: next requests 0-9 ms apart (batch_wait_ms 2)
    # before: the first arrival opened a batch alone, the others waited for it (>= 5 batches, +~20 % steps)
    assert staggered.stats["batches"] == 3, staggered.stats
    assert staggered.stats["decode_steps"] == together.stats["decode_steps"]


def test_the_wait_rules():
    async def scenario(expected: int, follow_batch_s: float, arrivals_ms: list[float], max_rows: int = 8) -> float:
        fill = BatchFill(0.002, max_rows)
        if expected:
            fill.delivered(expected, 0, follow_batch_s)
        queue: list[int] = []
        wakeup = asyncio.Event()

        async def arrive(ms: float) -> None:
            await asyncio.sleep(ms / 1000)
            queue.append(1)
            wakeup.set()

        tasks = [asyncio.create_task(arrive(ms)) for ms in arrivals_ms]
        t0 = time.perf_counter()
        await fill.wait(lambda: len(queue), wakeup, lambda: False)
        waited = time.perf_counter() - t0
        for t in tasks:
            t.cancel()
        return waited

    # no batch before: batch_wait_ms from now, whoever comes
    assert asyncio.run(scenario(0, 0, [50])) < 0.04
    # after a batch of 3 rows that took 0.4 s: waits for the third row (at 30 ms), not longer
    w = asyncio.run(scenario(3, 0.4, [0, 10, 30]))
    assert 0.025 < w < 0.09
    # ... and at most FOLLOW_SHARE of that batch's time when a sender does not come back
    w = asyncio.run(scenario(3, 0.2, [0, 10]))
    assert w == pytest.approx(FOLLOW_SHARE * 0.2, abs=0.03)
    # a full batch starts at once
    assert asyncio.run(scenario(3, 0.4, [0] * 8, max_rows=8)) < 0.03
