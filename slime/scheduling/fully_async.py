"""Fully-async rollout: a producer keeps groups in flight, a bounded buffer holds finished ones, and the trainer
consumes `rollout_batch_size` groups per step through a staleness filter.

Pure asyncio. What generates a group is injected (`GroupGenerator`), so the same code runs against SGLang
engines on the RolloutManager's event loop and against simulated engines on a virtual clock (the scheduling simulator).

The life of a group:

1. **Dispatch.** The producer takes one group from the data source (its buffer first: aborted and retried groups
   resume before fresh prompts). A resumed group whose tokens are already too old for the next consume is
   settled at once as stale (step 3) instead of being generated to its end. It dispatches while (a) it is not
   paused, (b) fewer than `max_in_flight_groups` groups generate, (c) the finished-groups buffer has room, and
   (d) with a staleness bound `k`, the group could still be consumed in time: with `ahead` groups queued before
   it (in flight or buffered) it trains at step `next_consume + ahead // B` at the earliest, and its tokens are
   no older than the engines' version `E`, so it is admitted only while `ahead < (k + E − next_consume + 1) × B`.
   This keeps the producer from generating work that is bound to be stale; it does not guarantee freshness (a
   long answer can be overtaken), the filter of step 3 does.
2. **Finish.** A group with an aborted sample (a weight sync, an eval or a stop interrupted it) goes back to the
   data source's buffer, the same path `--partial-rollout` uses, and resumes from its tokens with the rest of
   its budget. A group the dynamic filter rejects is dropped and counted. Anything else waits for room in the
   buffer.
3. **Consume.** The trainer at version `v` pops groups; a group with staleness `v − oldest trained-token
   version > k` is retried (its prompts start over, once) or dropped per `--async-unused-samples-handler`,
   and counted. A retried group that is stale again is dropped: its generation takes longer than the bound
   allows, and retrying it forever would loop.

Every prompt handed out is thus trained once, dropped (counted, with its prompt index), or still in the run
(buffered, in flight or waiting in the data source) — the property tests check exactly this.

Checkpoints (`state_dict`) hold the buffer, each in-flight group as it was when dispatched, and the consumed
and dropped prompt indices; taken in one step of the event loop, so nothing moves meanwhile.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from slime.scheduling.group_buffer import Group, GroupBufferLike, group_from_json, group_to_json
from slime.scheduling.stale_rule import HANDLERS, RETRIES_KEY, filter_stale_groups, settle_stale_group
from slime.scheduling.staleness import flatten, group_min_version, group_staleness, stamp_dispatch_version
from slime.utils.types import Status

logger = logging.getLogger(__name__)

__all__ = ["RETRIES_KEY", "AsyncConfig", "AsyncRollout", "filter_stale_groups", "settle_stale_group"]
_STATE_VERSION = 1


class GroupGenerator(Protocol):
    """What the producer needs from the inference side."""

    async def run_group(self, group: Group) -> Group:
        """Generate (and score) one prompt group; samples interrupted by `abort_all` come back ABORTED."""

    async def abort_all(self) -> None:
        """Make every running request, and every one about to start, return now with its tokens so far."""

    def allow(self) -> None:
        """Requests may start again (after `abort_all`)."""


class DataSourceLike(Protocol):
    def get_samples(self, num_groups: int) -> list[Group]: ...

    def add_samples(self, groups: list[Group]) -> None: ...


@dataclass
class AsyncConfig:
    batch_size: int  # groups the trainer consumes per step (--rollout-batch-size)
    max_in_flight_groups: int  # --async-max-concurrent-samples floored to whole groups
    max_staleness: int | None = None  # --max-weight-staleness; None: unbounded
    unused_handler: str = "retry"  # --async-unused-samples-handler: retry | drop | mask
    in_flight_updates: bool = False  # --update-weights-in-flight: a weight sync holds requests, never aborts them

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.max_in_flight_groups < 1:
            raise ValueError("batch_size and max_in_flight_groups must be >= 1")
        if self.unused_handler not in HANDLERS:
            raise ValueError(f"unused_handler must be one of {HANDLERS}, got {self.unused_handler!r}")


@dataclass
class _Counters:
    consumed_groups: int = 0
    stale_groups: int = 0
    stale_retried_groups: int = 0
    stale_dropped_groups: int = 0
    stale_masked_groups: int = 0
    stale_masked_tokens: int = 0
    doomed_in_flight_groups: int = 0  # in-flight updates: groups cut at a sync, already past the bound
    filtered_groups: int = 0
    aborted_groups: int = 0
    producer_wait_s: float = 0.0
    trainer_wait_s: float = 0.0
    staleness: list[int] = field(default_factory=list)  # of the groups consumed since the last report

    def counts(self) -> dict[str, float]:
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "staleness"}


def _prompt_index(group: Group) -> int:
    first = flatten(group)[0]
    if first.group_index is None:
        raise ValueError("a fully-async group has no group_index; the data source must set Sample.group_index")
    return first.group_index


def _unfinished(group: Group) -> bool:
    """Interrupted: a sample aborted mid-answer, or never started (the abort flag was up when its turn came)."""
    return any(s.status in (Status.ABORTED, Status.PENDING) for s in flatten(group))


class AsyncRollout:
    """The producer, the buffer and the staleness filter of one fully-async run (one event loop)."""

    def __init__(
        self,
        config: AsyncConfig,
        source: DataSourceLike,
        buffer: GroupBufferLike,
        generator: GroupGenerator,
        keep_group: Callable[[Group], tuple[bool, str | None]] | None = None,
        engine_version: int | None = None,
    ) -> None:
        self.config = config
        self.source = source
        self.buffer = buffer
        self.generator = generator
        self.keep_group = keep_group
        self.engine_version = engine_version
        self.next_consume: int | None = None  # the trainer version of the next consume
        self.consumed_ids: list[int] = []
        self.dropped_ids: list[int] = []
        self._in_flight: dict[asyncio.Task, tuple[bytes, int]] = {}  # task -> (group as dispatched, samples)
        self._generating: set[asyncio.Task] = set()  # the subset whose requests still occupy engines
        self._oldest: dict[asyncio.Task, int | None] = {}  # task -> oldest version its tokens can have
        self._doomed_tasks: set[asyncio.Task] = set()  # cut at an in-flight sync: settled as stale, not resumed
        self._changed = asyncio.Event()
        self._paused = False
        self._failure: BaseException | None = None
        self._producer: asyncio.Task | None = None
        self._window = _Counters()
        self._total = _Counters()
        self._max_buffer = 0

    # ---- what is where ---------------------------------------------------------------------------------
    @property
    def in_flight_groups(self) -> int:
        return len(self._in_flight)

    @property
    def in_flight_samples(self) -> int:
        return sum(n for _, n in self._in_flight.values())

    def totals(self) -> dict[str, float]:
        """Counts over the whole run (the per-step metrics are `consume`'s)."""
        return self._total.counts()

    def _count(self, name: str, n: float) -> None:
        """Add `n` to one counter, since the last consume and over the run."""
        setattr(self._window, name, getattr(self._window, name) + n)
        setattr(self._total, name, getattr(self._total, name) + n)

    @property
    def max_buffer_size(self) -> int:
        """The largest the buffer has been (a property test checks it never exceeds the capacity)."""
        return self._max_buffer

    def _loop_time(self) -> float:
        return asyncio.get_running_loop().time()

    def _notify(self) -> None:
        self._changed.set()

    async def _wait(self, predicate: Callable[[], bool]) -> float:
        """Wait until `predicate()`; returns the time waited. Raises the producer's failure if it has one."""
        t0 = self._loop_time()
        while not predicate():
            if self._failure is not None:
                raise RuntimeError("the fully-async producer failed") from self._failure
            self._changed.clear()
            await self._changed.wait()
        if self._failure is not None:
            raise RuntimeError("the fully-async producer failed") from self._failure
        return self._loop_time() - t0

    # ---- producer --------------------------------------------------------------------------------------
    def start(self, next_consume: int) -> None:
        """Start producing for a trainer whose next consume is at weight version `next_consume`."""
        self.next_consume = next_consume
        if self._producer is None:
            self._producer = asyncio.get_running_loop().create_task(self._produce(), name="async-rollout-producer")

    def _admit_limit(self) -> int | None:
        """How many groups may be queued ahead of a new one (in flight + buffered) under the staleness bound."""
        k = self.config.max_staleness
        if k is None or self.next_consume is None or self.engine_version is None:
            return None
        return (k + self.engine_version - self.next_consume + 1) * self.config.batch_size

    def _room(self) -> bool:
        if self._paused or len(self._generating) >= self.config.max_in_flight_groups:
            return False
        if len(self.buffer) >= self.buffer.capacity:
            return False
        limit = self._admit_limit()
        return limit is None or len(self._in_flight) + len(self.buffer) < limit

    def _blocked_by_consumer(self) -> bool:
        """Waiting for the trainer (a full buffer, or the staleness admission), as opposed to normal work."""
        return not self._paused and len(self._generating) < self.config.max_in_flight_groups

    async def _produce(self) -> None:
        try:
            while True:
                if not self._room():
                    blocked = self._blocked_by_consumer()
                    waited = await self._wait(self._room)
                    if blocked:
                        self._count("producer_wait_s", waited)
                groups = self.source.get_samples(1)
                if not groups:
                    raise RuntimeError("the data source returned no group; the fully-async producer cannot continue")
                if self._doomed(groups[0]):
                    self._handle_stale(groups[0])  # it could never train: settle it now, not after generating it
                    continue
                self._dispatch(groups[0])
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            logger.exception("fully-async producer failed")
            self._failure = e
            self._notify()
            raise

    def _doomed(self, group: Group) -> bool:
        """A resumed group whose tokens already exceed the bound for the next consume: versions only grow, so it
        can never be consumed. Every weight sync interrupts the groups in flight and they come back through the
        data source, so each is checked here once per sync."""
        return self._too_old(group_min_version(group))

    def _too_old(self, oldest: int | None) -> bool:
        """Tokens of version `oldest` could never train at the next consume or later (`mask` would mask them
        and train the rest, so under it nothing is too old to go on)."""
        k = self.config.max_staleness
        if k is None or self.next_consume is None or self.config.unused_handler == "mask":
            return False
        return oldest is not None and self.next_consume - oldest > k

    def _dispatch(self, group: Group) -> None:
        stamp_dispatch_version(group, self.engine_version)
        snapshot = pickle.dumps(group, protocol=pickle.HIGHEST_PROTOCOL)
        task = asyncio.get_running_loop().create_task(self._generate(group))
        self._in_flight[task] = (snapshot, len(flatten(group)))
        self._generating.add(task)
        versions = [v for v in (group_min_version(group), self.engine_version) if v is not None]
        self._oldest[task] = min(versions) if versions else None

    async def _generate(self, group: Group) -> None:
        task = asyncio.current_task()
        try:
            result = await self.generator.run_group(group)
        except asyncio.CancelledError:
            if task not in self._doomed_tasks:  # a doomed one was settled when it was cut (`resume`)
                snapshot, _ = self._in_flight.pop(task)
                self.source.add_samples([pickle.loads(snapshot)])  # as dispatched: it starts again later
            raise
        except BaseException as e:
            logger.exception("generating a fully-async group failed")
            self._failure = e
            self._in_flight.pop(task, None)
            raise
        finally:
            self._generating.discard(task)
            self._doomed_tasks.discard(task)
            self._oldest.pop(task, None)
            self._notify()  # an engine slot is free (or the failure is visible)
        try:
            if _unfinished(result):
                self._count("aborted_groups", 1)
                self.source.add_samples([result])  # resumes from its tokens, like a partial rollout
                return
            if self.keep_group is not None:
                keep, reason = self.keep_group(result)
                if not keep:
                    logger.debug("dynamic filter dropped group %d (%s)", _prompt_index(result), reason)
                    self._count("filtered_groups", 1)
                    self.dropped_ids.append(_prompt_index(result))
                    return
            try:
                await self._wait(lambda: len(self.buffer) < self.buffer.capacity)
            except asyncio.CancelledError:
                self.source.add_samples([result])  # finished; it passes through generation unchanged later
                raise
            self.buffer.put(result)
            self._max_buffer = max(self._max_buffer, len(self.buffer))
        finally:
            self._in_flight.pop(task, None)
            self._notify()

    # ---- engines paused (weight sync, eval) --------------------------------------------------------------
    async def pause(self, poll_s: float = 1.0) -> None:
        """Stop dispatching and interrupt every running request; returns once no request occupies an engine.
        Interrupted groups go back to the data source and resume after `resume`. `abort_all` is repeated until
        they are all back, so a request that reached its engine just after an abort is caught by the next."""
        self._paused = True
        self._notify()
        while self._generating:
            await self.generator.abort_all()
            if self._generating:  # they may all have come back while the abort was being sent
                await asyncio.wait(set(self._generating), timeout=poll_s)
        if self._failure is not None:
            raise RuntimeError("the fully-async producer failed") from self._failure

    def hold(self) -> None:
        """An in-flight weight sync begins (`--update-weights-in-flight`): no new group is dispatched until
        `resume`; the running requests stay on their engines (paused there in place) and go on afterwards."""
        self._paused = True
        self._notify()

    def resume(self, engine_version: int | None = None) -> None:
        """Generation may continue, with the engines now at `engine_version` (when given). After an in-flight
        sync, a group whose oldest tokens can no longer train is cut now and settled as stale (retried or
        dropped) instead of being generated to its end and thrown away at the consume."""
        if engine_version is not None:
            self.engine_version = engine_version
        self.generator.allow()
        self._paused = False
        if self.config.in_flight_updates:
            for task in [t for t in self._generating if self._too_old(self._oldest.get(t))]:
                # settled now, in this step of the loop (a checkpoint or a stop right after sees it settled);
                # what it generated since its dispatch is lost
                snapshot, _ = self._in_flight.pop(task)
                self._doomed_tasks.add(task)
                self._count("doomed_in_flight_groups", 1)
                self._handle_stale(pickle.loads(snapshot))
                task.cancel()
        self._notify()

    async def stop(self) -> None:
        """Stop producing. Afterwards every group not consumed or dropped is in the buffer or the data source:
        interrupted ones resume from their tokens, finished ones waiting for room pass through unchanged."""
        if self._producer is not None:
            self._producer.cancel()
            await asyncio.gather(self._producer, return_exceptions=True)
            self._producer = None
        await self.pause()
        # groups that finished but wait for room in the buffer go back to the data source
        waiting = list(self._in_flight)
        for t in waiting:
            t.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)

    # ---- consumer ----------------------------------------------------------------------------------------
    async def consume(self, rollout_id: int) -> tuple[list[Group], dict[str, float]]:
        """`batch_size` groups for the trainer at weight version `rollout_id`, each within the staleness bound."""
        self.next_consume = rollout_id
        self._notify()
        k = self.config.max_staleness
        taken: list[Group] = []
        waited = 0.0
        while len(taken) < self.config.batch_size:
            waited += await self._wait(lambda: len(self.buffer) > 0)
            for group in self.buffer.pop(self.config.batch_size - len(taken)):
                staleness = group_staleness(group, rollout_id)
                if k is not None and staleness > k and not self._handle_stale(group, rollout_id):
                    continue
                taken.append(group)
                self._window.staleness.append(group_staleness(group, rollout_id))
            self._notify()
        self.next_consume = rollout_id + 1
        self._count("trainer_wait_s", waited)
        self._count("consumed_groups", len(taken))
        self.consumed_ids.extend(_prompt_index(g) for g in taken)
        self._notify()
        taken.sort(key=lambda g: flatten(g)[0].index if flatten(g)[0].index is not None else -1)
        return taken, self._report()

    def _handle_stale(self, group: Group, trainer_version: int | None = None) -> bool:
        """Settle a group over the bound; True when it is kept (masked into the bound) and trains now."""
        self._count("stale_groups", 1)
        k = self.config.max_staleness or 0
        verdict, masked = settle_stale_group(group, self.config.unused_handler, self.source, trainer_version, k)
        if verdict == "kept":
            self._count("stale_masked_groups", 1)
            self._count("stale_masked_tokens", masked)
            return True
        if verdict == "retried":
            self._count("stale_retried_groups", 1)
        else:
            self.dropped_ids.append(_prompt_index(group))
            self._count("stale_dropped_groups", 1)
        return False

    def _report(self) -> dict[str, float]:
        """Metrics since the previous consume (rates) plus the state now (sizes, totals)."""
        w = self._window
        m: dict[str, float] = {
            "async/buffer_size": float(len(self.buffer)),
            "async/in_flight_groups": float(self.in_flight_groups),
            "async/in_flight_samples": float(self.in_flight_samples),
            **{f"async/{k}": float(v) for k, v in w.counts().items() if k != "consumed_groups"},
            "async/dropped_groups_total": float(len(self.dropped_ids)),
            "async/engine_version": float(self.engine_version if self.engine_version is not None else -1),
        }
        if w.staleness:
            m["async/staleness_mean"] = sum(w.staleness) / len(w.staleness)
            m["async/staleness_max"] = float(max(w.staleness))
        versions = [v for v in map(group_min_version, self.buffer) if v is not None]
        if versions and self.next_consume is not None:
            m["async/buffer_staleness_max"] = float(self.next_consume - min(versions))
        self._window = _Counters()
        return m

    # ---- checkpoint --------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """JSON-able; synchronous, so taken within one step of the event loop."""
        return {
            "version": _STATE_VERSION,
            "buffer": [group_to_json(g) for g in self.buffer],
            "in_flight": [group_to_json(pickle.loads(s)) for s, _ in self._in_flight.values()],
            "consumed_ids": list(self.consumed_ids),
            "dropped_ids": list(self.dropped_ids),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Buffered groups return to the buffer (overflow, after a smaller capacity, to the data source), in-flight
        groups to the data source's buffer as dispatched; a group whose prompt was already consumed is skipped."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"fully-async state version {state.get('version')}; expected {_STATE_VERSION}")
        self.consumed_ids = list(state["consumed_ids"])
        self.dropped_ids = list(state["dropped_ids"])
        done = set(self.consumed_ids) | set(self.dropped_ids)
        overflow: list[Group] = []
        for data in state["buffer"]:
            group = group_from_json(data)
            if _prompt_index(group) in done:
                logger.warning(
                    "checkpointed buffer holds group %d, already trained or dropped; skipped", _prompt_index(group)
                )
            elif len(self.buffer) < self.buffer.capacity:
                self.buffer.put(group)
            else:
                overflow.append(group)
        resumed = [group_from_json(d) for d in state["in_flight"]]
        resumed = [g for g in resumed if _prompt_index(g) not in done]
        if overflow or resumed:
            self.source.add_samples(overflow + resumed)
        logger.info(
            "fully-async state: %d buffered, %d resumed in flight, %d consumed, %d dropped",
            len(self.buffer), len(overflow) + len(resumed), len(self.consumed_ids), len(self.dropped_ids),
        )  # fmt: skip
