"""An asyncio event loop on a virtual clock: when nothing is ready it jumps to the next timer instead of sleeping.

Why: the scheduling simulator runs slime's real asyncio code (producer, buffer, staleness filter, loop driver)
against simulated engines and a simulated trainer whose work is `asyncio.sleep`. On this loop a simulated hour
takes as long as the Python it executes, and the order of events depends only on the code and its inputs, so
a seed fixes the whole run.

Only timers move time: the simulation uses no sockets and no threads (a callback from another thread would
find the loop already at its next timer). A loop with nothing ready and no timer pending is a deadlock of the
simulated system, raised as `SimulationDeadlock` instead of hanging.
"""

from __future__ import annotations

import asyncio
import selectors
from typing import Any


class SimulationDeadlock(RuntimeError):
    """Every task waits and no timer is pending: the simulated system can never move again."""


class _JumpingSelector(selectors.SelectSelector):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0

    def select(self, timeout: float | None = None) -> list[Any]:
        if timeout is None:
            raise SimulationDeadlock("no task can run and no timer is pending")
        self.now += max(0.0, timeout)
        return []


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """`loop.time()` starts at 0 and advances only to the next scheduled timer."""

    def __init__(self) -> None:
        self._jumping = _JumpingSelector()
        super().__init__(selector=self._jumping)

    def time(self) -> float:
        return self._jumping.now


def run_virtual(coro: Any) -> Any:
    """Run `coro` to completion on a fresh virtual-clock loop; returns its result."""
    loop = VirtualClockLoop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()
