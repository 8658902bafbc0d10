"""A FIFO semaphore for asyncio whose release is O(1) however many tasks wait.

Why not `asyncio.Semaphore`: in CPython 3.11 its release walks the waiter deque from the front past every waiter
already woken but not yet run (they leave the deque only when they run, with an O(n) `remove`). When a step's
worth of permits is released in one turn of the loop — thousands of answers ending together, a weight sync
resuming — that is quadratic: in the scheduling simulator at 30k samples per step, with one waiter per slot,
`Future.done` ran ~120 times per sample (bench/orchestration_scale.py, docs/performance.md#orchestration-at-scale).
Here a release hands its permit to the first waiter still waiting and pops it; cancelled waiters are skipped
when reached, so every waiter is passed over at most once.
"""

from __future__ import annotations

import asyncio
from collections import deque
from types import TracebackType


class FifoSemaphore:
    """`async with sem:` like `asyncio.Semaphore(value)`, first come first served."""

    def __init__(self, value: int) -> None:
        if value < 0:
            raise ValueError("semaphore value must be >= 0")
        self._value = value
        self._waiters: deque[asyncio.Future] = deque()

    def locked(self) -> bool:
        return self._value == 0

    async def acquire(self) -> bool:
        if self._value > 0 and not self._first_waiting():
            self._value -= 1
            return True
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # granted, then cancelled before it ran: pass the permit on
                self.release()
            raise
        return True

    def _first_waiting(self) -> list[asyncio.Future]:
        """The first waiter still waiting, if any (cancelled ones at the front are dropped on the way)."""
        while self._waiters and self._waiters[0].done():
            self._waiters.popleft()
        return [self._waiters[0]] if self._waiters else []

    def release(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # the permit goes to it directly: the count does not change
                return
        self._value += 1

    async def __aenter__(self) -> None:
        await self.acquire()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()
