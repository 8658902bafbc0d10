"""Simulated inference engines for the scheduling simulator, and the generate / reward hooks that reach them.

Each engine does continuous batching as `sim/fake_sglang`'s scheduler does (requests join and leave the running
batch at every decode step, at most `slots_per_engine` run, the rest wait), but as a fluid model on the virtual
clock: between two events (a request joins, finishes or is aborted) the running set is fixed, so every request
advances at one token per decode step of `decode_step(running)` seconds, and the next event time is computed
instead of stepping token by token. Prefill stalls the engine's batch for `prefill_per_token_s` per context
token. Requests go to the least-loaded engine (running + waiting; the lowest index on a tie).

Weight syncs, both ways SGLang pauses: `abort_all` (the default, drained: every request answers with its tokens
so far and a resumed one prefills its whole context again) or `pause_in_place` (SGLang's `in_place`: requests
stay in the batch with their KV cache, nothing decodes until `continue_generation`, and a request's tokens are
split by the version they were decoded under: the exact per-token versions the real client can only bound).

`generate` and `reward` are slime hooks (`--custom-generate-function-path`, `--custom-rm-path`): the simulator
runs slime's own per-sample path (`generate_and_rm`: semaphore, abort flag, partial-rollout masking, reward)
and only the `/generate` call itself is simulated. They find the running simulation through a context variable.
"""

from __future__ import annotations

import asyncio
import contextvars
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from sim.workloads.long_tail import Workload
from slime.scheduling.fully_async import RETRIES_KEY
from slime.utils.types import Sample, Status

_EPS = 1e-6


@dataclass
class _Request:
    want: int  # tokens to produce; then it finishes with `finish`
    finish: str  # "stop" (the answer ended) or "length" (the budget ran out)
    context: int  # tokens to prefill when it joins the batch
    future: asyncio.Future
    done: float = 0.0  # tokens produced so far (fractional between events)
    marks: list[tuple[int, int]] = field(default_factory=list)  # (version, tokens produced before it changed)


class SimEngine:
    def __init__(self, index: int, workload: Workload) -> None:
        self.index = index
        self.w = workload
        self.running: list[_Request] = []
        self.waiting: deque[_Request] = deque()
        self.version = 0
        self.stall_until = 0.0
        self.last = 0.0
        self.busy_slot_s = 0.0
        self.tokens = 0
        self.prefill_tokens = 0  # context tokens prefilled (a drained sync's resumes prefill theirs again)
        self.paused = False  # in place: requests kept, nothing decodes
        self._timer: asyncio.TimerHandle | None = None

    @property
    def load(self) -> int:
        return len(self.running) + len(self.waiting)

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    def _advance(self) -> None:
        now = self._now()
        n = len(self.running)
        if self.paused:  # slots held, no decoding: not busy work
            self.last = max(self.last, now)
            return
        if now > self.last and n:
            self.busy_slot_s += n * (now - self.last)
            decoding = now - max(self.last, self.stall_until)
            if decoding > 0:
                step = decoding / self.w.decode_step(n)
                for r in self.running:
                    r.done = min(float(r.want), r.done + step)
        self.last = max(self.last, now)

    def _settle(self) -> None:
        """Finish what reached its target, admit waiting requests, schedule the next completion."""
        now = self._now()
        still = []
        for r in self.running:
            if r.done >= r.want - _EPS:
                self._resolve(r, r.want, r.finish)
            else:
                still.append(r)
        self.running = still
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.paused:
            return
        while self.waiting and len(self.running) < self.w.slots_per_engine:
            r = self.waiting.popleft()
            self.stall_until = max(now, self.stall_until) + self.w.prefill_per_token_s * r.context
            self.prefill_tokens += r.context
            self.running.append(r)
        if self.running:
            left = min(r.want - r.done for r in self.running)
            at = max(now, self.stall_until) + left * self.w.decode_step(len(self.running))
            self._timer = asyncio.get_running_loop().call_at(at, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._advance()
        # the earliest request finishes now; float rounding may leave it a hair short
        if self.running:
            first = min(self.running, key=lambda r: r.want - r.done)
            if first.want - first.done < 1e-3:
                first.done = float(first.want)
        self._settle()

    def _resolve(self, r: _Request, tokens: int, finish: str) -> None:
        self.tokens += tokens
        if not r.future.done():
            r.future.set_result((tokens, finish, self._spans(r, tokens)))

    def _spans(self, r: _Request, tokens: int) -> list[tuple[int, int]]:
        """(version, tokens) in order: the tokens decoded under each version this request saw."""
        spans, before = [], 0
        for version, upto in r.marks:
            n = min(upto, tokens) - before
            if n > 0:
                spans.append((version, n))
                before += n
        if tokens - before > 0 or not spans:
            spans.append((self.version, tokens - before))
        return spans

    def submit(self, want: int, finish: str, context: int) -> _Request:
        r = _Request(want, finish, context, asyncio.get_running_loop().create_future())
        self._advance()
        self.waiting.append(r)
        self._settle()
        return r

    def drop(self, r: _Request) -> None:
        """The caller went away (its task was cancelled): the request leaves the batch."""
        self._advance()
        if r in self.running:
            self.running.remove(r)
            self.tokens += math.floor(r.done)
        elif r in self.waiting:
            self.waiting.remove(r)
        self._settle()

    def abort_all(self) -> int:
        """Every request answers now with its tokens so far (finish "abort"), as SGLang's abort_all does."""
        self._advance()
        n = 0
        for r in [*self.running, *self.waiting]:
            self._resolve(r, math.floor(r.done + _EPS), "abort")
            n += 1
        self.running, self.waiting = [], deque()
        self._settle()
        return n

    def pause_in_place(self) -> None:
        self._advance()
        self.paused = True
        self._settle()

    def continue_generation(self) -> None:
        self._advance()
        self.paused = False
        self.stall_until = max(self.stall_until, self._now())
        self._settle()

    def set_version(self, version: int) -> None:
        """Drained, the engine must be idle; paused in place, each kept request remembers where its tokens under
        the old version end."""
        if self.load and not self.paused:
            raise RuntimeError(f"engine {self.index} loads weights with {self.load} requests running")
        for r in [*self.running, *self.waiting]:
            r.marks.append((self.version, math.floor(r.done + _EPS)))
        self.version = version


@dataclass
class EnginePool:
    workload: Workload
    engines: list[SimEngine] = field(init=False)

    def __post_init__(self) -> None:
        self.engines = [SimEngine(i, self.workload) for i in range(self.workload.engines)]

    async def generate(self, want: int, finish: str, context: int) -> tuple[int, str, list[tuple[int, int]]]:
        """(tokens produced, finish type, [(weight version, tokens)]) of one request on the least-loaded engine."""
        engine = min(self.engines, key=lambda e: (e.load, e.index))
        r = engine.submit(want, finish, context)
        try:
            return await r.future
        except asyncio.CancelledError:
            engine.drop(r)
            raise

    async def abort_all(self) -> None:
        for e in self.engines:
            e.abort_all()

    def set_version(self, version: int) -> None:
        for e in self.engines:
            e.set_version(version)

    def pause_in_place(self) -> None:
        for e in self.engines:
            e.pause_in_place()

    def continue_generation(self) -> None:
        for e in self.engines:
            e.continue_generation()

    def settle_accounting(self) -> None:
        """Bring every engine's busy time up to now (before reading it)."""
        for e in self.engines:
            e._advance()

    @property
    def busy_slot_s(self) -> float:
        return sum(e.busy_slot_s for e in self.engines)

    @property
    def tokens(self) -> int:
        return sum(e.tokens for e in self.engines)

    @property
    def prefill_tokens(self) -> int:
        return sum(e.prefill_tokens for e in self.engines)


# ---- slime hooks -----------------------------------------------------------------------------------------------
CURRENT: contextvars.ContextVar[Any] = contextvars.ContextVar("sim_scheduling_current")


async def generate(args: Any, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    """The simulated `/generate`: continues `sample` like slime's default generate (remaining budget, one weight
    version per answer, an abort returns the tokens so far), with lengths from the workload."""
    sim = CURRENT.get()
    w: Workload = sim.workload
    prompt_len = w.prompt_length(sample.group_index)
    if not sample.tokens:
        sample.tokens = [0] * prompt_len
    budget = int(sampling_params["max_new_tokens"]) - sample.response_length
    if budget <= 0:
        sample.status = Status.TRUNCATED
        return sample
    target = w.response_length(sample.index, int(sample.metadata.get(RETRIES_KEY, 0)))
    remaining = target - sample.response_length
    want, finish = (remaining, "stop") if remaining <= budget else (budget, "length")
    n, finish, spans = await sim.pool.generate(want, finish, prompt_len + sample.response_length)
    sample.tokens = sample.tokens + [1] * n
    sample.response_length += n
    if sample.loss_mask is not None:
        sample.loss_mask = sample.loss_mask + [1] * n
    sample.update_from_meta_info(args, {"finish_reason": {"type": finish}})
    for version, k in spans:  # exact per-token versions (an in-flight answer may span several)
        sample.weight_versions.append(str(version))
        sample.weight_version_spans.append([str(version), k, True])
    return sample


async def reward(args: Any, sample: Sample) -> float:
    """A reward the schedule cannot change: 1 for odd sample indices."""
    return float(sample.index % 2)
