"""When the hf backend's worker stops waiting and starts the next batch.

A batch that starts a moment too early leaves out the trials about to send their next request (a
fixed `batch_wait_ms` gave 6 batches and 21 % more decode steps on the tiny model; issue 30, item 6).
`BatchFill` waits, after a batch, for as many rows as it held plus those it left queued, for at most
`FOLLOW_SHARE` of its duration (capped at `FOLLOW_CAP_S`); otherwise `batch_wait_ms` from the first
row. Which rows fit the budget is `memory_plan.admit`'s decision. docs/benchmark.md, "Inside the
`hf` backend"; measurements in docs/performance.md."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

FOLLOW_SHARE = 0.25
FOLLOW_CAP_S = 0.5


class BatchFill:
    def __init__(self, batch_wait_s: float, max_rows: int):
        self.batch_wait_s, self.max_rows = batch_wait_s, max_rows
        self.expected = 0  # rows expected back: those the last batch answered and those it left queued
        self.follow_s = 0.0

    def delivered(self, rows: int, left_queued: int, seconds: float) -> None:
        """A batch of `rows` rows took `seconds`; `left_queued` rows were waiting when it ended."""
        self.expected = min(self.max_rows, rows + left_queued)
        self.follow_s = min(FOLLOW_CAP_S, FOLLOW_SHARE * seconds)

    async def wait(self, queued: Callable[[], int], wakeup: asyncio.Event, closed: Callable[[], bool]) -> None:
        """Return when the next batch should start: `max_rows` rows are queued; or, after a batch, the
        rows expected back are (and `batch_wait_s` has passed) or its follow-up time is over; or,
        otherwise, `batch_wait_s` has passed since now."""
        start = time.perf_counter()
        short = start + self.batch_wait_s
        long = start + max(self.batch_wait_s, self.follow_s) if self.expected else short
        want = self.expected
        self.expected, self.follow_s = 0, 0.0  # one follow-up wait per batch
        while queued() < self.max_rows and not closed():
            now = time.perf_counter()
            if now >= long or (now >= short and queued() >= want):
                return
            wakeup.clear()
            deadline = short if queued() >= want else long
            try:
                await asyncio.wait_for(wakeup.wait(), timeout=max(0.0, deadline - now))
            except TimeoutError:
                continue
