"""Engines as independent slots, for measuring slime's driver at scale (`bench/orchestration_scale.py`).

`EnginePool` models continuous batching, and every event walks an engine's running batch: at 512 engines and
100k samples per step the simulator's own work would swamp the driver code being measured. Here each request
simply takes `want × decode_step(1)` seconds of virtual time (no batching slowdown, no prefill), so the
simulator costs O(1) per request and what grows with scale is slime's: the producer, buffer, staleness rule,
data source and loop. Same interface as `EnginePool`: drained syncs (`abort_all`) and in-place pauses, with
exact per-token versions.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field

from sim.workloads.long_tail import Workload


@dataclass(eq=False)  # kept in a set by identity
class _Req:
    want: int
    finish: str
    future: asyncio.Future
    started: float
    done: float = 0.0  # tokens decoded before the current run started
    marks: list[tuple[int, int]] = field(default_factory=list)
    timer: asyncio.TimerHandle | None = None


class SlotPool:
    def __init__(self, workload: Workload) -> None:
        self.w = workload
        self.step = workload.decode_step(1)
        self.version = 0
        self.paused = False
        self.pending: set[_Req] = set()
        self.tokens = 0
        self.prefill_tokens = 0
        self.busy_slot_s = 0.0

    def _loop(self) -> asyncio.AbstractEventLoop:
        return asyncio.get_running_loop()

    def _run(self, r: _Req) -> None:
        r.started = self._loop().time()
        r.timer = self._loop().call_at(r.started + (r.want - r.done) * self.step, self._finish, r, r.want, r.finish)

    def _progress(self, r: _Req) -> float:
        return r.done if self.paused else min(r.want, r.done + (self._loop().time() - r.started) / self.step)

    def _finish(self, r: _Req, tokens: int, finish: str) -> None:
        self.pending.discard(r)
        self.tokens += tokens
        self.busy_slot_s += tokens * self.step
        spans, before = [], 0
        for version, upto in r.marks:
            n = min(upto, tokens) - before
            if n > 0:
                spans.append((version, n))
                before += n
        if tokens - before > 0 or not spans:
            spans.append((self.version, tokens - before))
        if not r.future.done():
            r.future.set_result((tokens, finish, spans))

    async def generate(self, want: int, finish: str, context: int) -> tuple[int, str, list[tuple[int, int]]]:
        r = _Req(want, finish, self._loop().create_future(), self._loop().time())
        self.pending.add(r)
        self.prefill_tokens += context
        if not self.paused:
            self._run(r)
        try:
            return await r.future
        except asyncio.CancelledError:
            if r.timer is not None:
                r.timer.cancel()
            self.pending.discard(r)
            self.tokens += math.floor(self._progress(r))
            raise

    async def abort_all(self) -> None:
        for r in list(self.pending):
            if r.timer is not None:
                r.timer.cancel()
            self._finish(r, math.floor(self._progress(r) + 1e-6), "abort")

    def pause_in_place(self) -> None:
        for r in self.pending:
            r.done = self._progress(r)
            if r.timer is not None:
                r.timer.cancel()
                r.timer = None
        self.paused = True

    def continue_generation(self) -> None:
        self.paused = False
        for r in self.pending:
            self._run(r)

    def set_version(self, version: int) -> None:
        for r in self.pending:
            r.marks.append((self.version, math.floor(self._progress(r) + 1e-6)))
        self.version = version

    def settle_accounting(self) -> None:
        """Busy time is booked when a request ends."""
