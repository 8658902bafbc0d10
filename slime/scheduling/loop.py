"""The one loop: the order of a training run's events in every schedule, written once against `LoopBackend`.

Every run goes through it. The Ray run (`slime/ray/loop_backend.py`) and the scheduling simulator
(the scheduling simulator) are two backends of the same events, so the order the simulator measures is the order a
real run follows. Per rollout id r, in every schedule:

    eval (when due) → the batch → release the engines (colocated) → train → save, save_hf (when due)
        → engines' weights memory back (colocated) → weight sync (when due) → engines' KV cache back (colocated)

How the batch comes:

- **sync**: rollout r is generated (`rollout`), then turned into train data (`train_data`). Generation and
  training alternate.
- **one_step** (`--one-step-ahead`): rollout r+1 is launched as soon as rollout r is train data, so it generates
  while step r trains: every batch is one weight version old (up to `--update-weights-interval`). Before a
  weight sync the loop waits for the rollout in flight, so weights never change under a rollout.
- **fully_async** (`--fully-async`): a producer generates all the time (`start_producer` before the first step,
  `stop_producer` at the end; `slime/scheduling/fully_async.py`); each step consumes a batch within the
  staleness bound, and a weight sync pauses generation, loads and continues.

Before the first step the engines get the trainer's weights (version = the first rollout id), so they serve
exactly the trainer's weights from the start; after the last step one more eval runs (with `--eval-interval`).
Colocated runs (`--offload-rollout`) release the engines' memory once the batch is in and take it back at every
step's sync point, weights first, so the sync writes into the engines' weights while their KV cache is still
away (docs/architecture.md#colocated-offload). The trainer's own sleep and wake-up are its backend's: the loop
tells each train call whether a weight sync follows (`keep_weights`: the sync then reads the weights where the
train call left them).

Events are recorded as `(kind, id)`: `sync` carries the weight version pushed, every other kind the rollout id.
The loop times its phases itself (`STEP_PHASES`, on the event loop's clock: the simulator's is virtual) and
hands them to `step_done` with the step's wall time.
"""

from __future__ import annotations

import asyncio
import contextlib
from argparse import Namespace
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

MODES = ("sync", "one_step", "fully_async")
# A step's phases as the loop times them. They never overlap, so their sum is the step's wall time up to
# `time/unaccounted` (the backend's own bookkeeping and logging between events).
STEP_PHASES = (
    "time/eval",
    "time/rollout",  # how long the trainer waited for its batch (and, one step ahead, for the rollout in flight)
    "time/engine_release",
    "time/train_total",
    "time/save",
    "time/save_hf",
    "time/weight_sync",
    "time/engine_resume",
)


def mode_from_args(args: Namespace) -> str:
    if args.fully_async:
        return "fully_async"
    return "one_step" if args.one_step_ahead else "sync"


@dataclass(frozen=True)
class LoopPlan:
    mode: str
    start: int
    num_rollout: int
    update_weights_interval: int = 1
    save: bool = False  # --save: a checkpoint at every save point
    save_hf: bool = False  # --save-hf: an HF export at every save point
    save_interval: int | None = None
    eval_interval: int | None = None
    skip_eval_before_train: bool = False
    sync_weights: bool = True  # off in the debug modes: no engine to sync, or nothing trained
    offload_rollout: bool = False  # colocated: the engines give their GPU memory to the trainer between rollouts

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")

    @classmethod
    def from_args(cls, args: Namespace, start: int) -> LoopPlan:
        """`args`: the actor's (its checkpoint flags may come from --megatron-config)."""
        debug = args.debug_rollout_only or args.debug_train_only
        return cls(
            mode=mode_from_args(args),
            start=start,
            num_rollout=args.num_rollout,
            update_weights_interval=args.update_weights_interval,
            save=bool(args.save),
            save_hf=bool(args.save_hf),
            save_interval=args.save_interval,
            eval_interval=args.eval_interval,
            skip_eval_before_train=args.skip_eval_before_train,
            sync_weights=not debug,
            offload_rollout=args.offload_rollout,
        )

    def eval_due(self, rollout_id: int) -> bool:
        if not self.eval_interval or rollout_id % self.eval_interval:
            return False
        return rollout_id > self.start or not self.skip_eval_before_train

    def save_due(self, rollout_id: int) -> bool:
        """Every --save-interval rollouts and always after the last one (as slime does)."""
        if not (self.save or self.save_hf):
            return False
        last = rollout_id == self.num_rollout - 1
        return last or bool(self.save_interval and (rollout_id + 1) % self.save_interval == 0)

    def sync_due(self, rollout_id: int) -> bool:
        return self.sync_weights and (rollout_id + 1) % self.update_weights_interval == 0


class LoopBackend:
    """What the loop asks of a run: one method per event, each a no-op here. A backend overrides the events its
    runs have, and the loop refuses to start a plan whose events it lacks (`required_events`). `rollout` generates
    a rollout and keeps it; `train_data` turns the kept rollout into the trainer's batch (two calls, so the
    one-step loop converts rollout r, whose carry-over and checkpoint state come first, before it launches
    rollout r+1)."""

    async def evaluate(self, rollout_id: int) -> None:
        """Eval before rollout `rollout_id` (and after the last one)."""

    async def rollout(self, rollout_id: int) -> None:
        """Generate rollout `rollout_id` and keep it (one step ahead, while the previous step trains)."""

    async def train_data(self, rollout_id: int) -> Any:
        """The kept rollout as the trainer's batch (its carry-over and checkpoint state settled now)."""

    async def start_producer(self, rollout_id: int) -> None:
        """Fully async: start generating, for a trainer at weight version `rollout_id`."""

    async def consume(self, rollout_id: int) -> Any:
        """Fully async: the next batch of finished groups within the staleness bound."""

    async def stop_producer(self) -> None:
        """Fully async: stop generating; what is unfinished goes back where a checkpoint finds it."""

    async def release_engines(self) -> None:
        """Colocated: the engines free their GPU memory for the trainer."""

    async def train(self, rollout_id: int, batch: Any, keep_weights: bool) -> None:
        """`keep_weights`: a weight sync follows, which reads the weights where this call leaves them."""

    async def save(self, rollout_id: int) -> None:
        """A checkpoint after step `rollout_id`: the trainer's state and the rollout side's, complete or not at all."""

    async def save_hf(self, rollout_id: int) -> None:
        """The trainer's weights as an HF checkpoint."""

    async def resume_engine_weights(self) -> None:
        """Colocated: the engines take back the memory of their weights (before the sync writes them)."""

    async def sync_weights(self, version: int) -> None:
        """The engines get the trainer's weights as `version`; no rollout is generating under the old ones then."""

    async def resume_engine_cache(self) -> None:
        """Colocated: the engines take back the rest (KV cache, CUDA graphs) once the sync is done."""

    async def started(self, times: dict[str, float]) -> None:
        """The engines hold the trainer's first weights: start-up is over (`times`: that sync's phases)."""

    async def step_done(self, rollout_id: int, times: dict[str, float]) -> None:
        """Step `rollout_id` is over (trained, saved and synced as due); `times`: its phases (`STEP_PHASES`), wall
        time (`time/step`) and `time/unaccounted`."""


def required_events(plan: LoopPlan) -> list[str]:
    """The events `plan` calls that have no meaningful default: a backend must define them."""
    fully_async = plan.mode == "fully_async"
    events = ["start_producer", "consume", "stop_producer"] if fully_async else ["rollout", "train_data"]
    optional = (("save", plan.save), ("save_hf", plan.save_hf), ("sync_weights", plan.sync_weights))
    return [*events, "train", *(event for event, used in optional if used)]


Recorder = Callable[[str, int], None]


class _Phases:
    """Records each event and adds its duration to its phase; `take()` hands a step's phases over."""

    def __init__(self, record: Recorder | None) -> None:
        self.record = record or (lambda kind, ident: None)
        self.times: dict[str, float] = {}
        self.step_t0 = self.now()

    @staticmethod
    def now() -> float:
        return asyncio.get_running_loop().time()

    @contextlib.asynccontextmanager
    async def phase(self, key: str) -> AsyncIterator[None]:
        t0 = self.now()
        try:
            yield
        finally:
            self.times[key] = self.times.get(key, 0.0) + self.now() - t0

    async def event(self, kind: str, ident: int, key: str, work: Awaitable[Any]) -> Any:
        self.record(kind, ident)
        async with self.phase(key):
            return await work

    def take(self) -> dict[str, float]:
        now = self.now()
        times, self.times = self.times, {}
        times["time/step"] = now - self.step_t0
        times["time/unaccounted"] = times["time/step"] - sum(times.get(k, 0.0) for k in STEP_PHASES)
        self.step_t0 = now
        return times


async def run_loop(plan: LoopPlan, backend: LoopBackend, record: Recorder | None = None) -> None:
    """Run rollouts `plan.start .. plan.num_rollout - 1` in the plan's schedule."""
    missing = [e for e in required_events(plan) if getattr(type(backend), e) is getattr(LoopBackend, e)]
    if missing:
        raise TypeError(f"{type(backend).__name__} cannot run this plan: it has no {', '.join(missing)} event")
    clock = _Phases(record)

    async def sync_point(rollout_id: int, version: int | None) -> None:
        """Colocated: the engines' weights memory back, the weights (when due), then the rest of their memory."""
        if plan.offload_rollout:
            await clock.event("resume_weights", rollout_id, "time/engine_resume", backend.resume_engine_weights())
        if version is not None:
            await clock.event("sync", version, "time/weight_sync", backend.sync_weights(version))
        if plan.offload_rollout:
            await clock.event("resume_cache", rollout_id, "time/engine_resume", backend.resume_engine_cache())

    def launch(rollout_id: int) -> asyncio.Future:
        clock.record("rollout", rollout_id)
        return asyncio.ensure_future(backend.rollout(rollout_id))

    if plan.sync_weights:
        await sync_point(plan.start, plan.start)  # the engines serve the trainer's weights from the first rollout on
    await backend.started(clock.take())
    if plan.mode == "fully_async":
        clock.record("start_producer", plan.start)
        await backend.start_producer(plan.start)
    pending: asyncio.Future | None = None
    try:
        for rollout_id in range(plan.start, plan.num_rollout):
            if plan.eval_due(rollout_id):
                await clock.event("eval", rollout_id, "time/eval", backend.evaluate(rollout_id))
            async with clock.phase("time/rollout"):
                if plan.mode == "fully_async":
                    clock.record("consume", rollout_id)
                    batch = await backend.consume(rollout_id)
                else:
                    if pending is None:
                        pending = launch(rollout_id)
                    await pending
                    pending = None
                    clock.record("train_data", rollout_id)
                    batch = await backend.train_data(rollout_id)
            if plan.mode == "one_step" and rollout_id + 1 < plan.num_rollout:
                pending = launch(rollout_id + 1)
            if plan.offload_rollout:
                await clock.event("release", rollout_id, "time/engine_release", backend.release_engines())
            sync_due = plan.sync_due(rollout_id)
            await clock.event("train", rollout_id, "time/train_total", backend.train(rollout_id, batch, sync_due))
            if plan.save_due(rollout_id):
                if plan.save:
                    await clock.event("save", rollout_id, "time/save", backend.save(rollout_id))
                if plan.save_hf:
                    await clock.event("save_hf", rollout_id, "time/save_hf", backend.save_hf(rollout_id))
            if plan.sync_weights:
                if sync_due and pending is not None:
                    async with clock.phase("time/rollout"):
                        await pending  # weights never change under a rollout of the one-step loop
                await sync_point(rollout_id, rollout_id + 1 if sync_due else None)
            await backend.step_done(rollout_id, clock.take())
        if plan.eval_interval:
            await clock.event("eval", plan.num_rollout, "time/eval", backend.evaluate(plan.num_rollout))
    finally:
        if pending is not None and not pending.done():
            pending.cancel()
            await asyncio.gather(pending, return_exceptions=True)
        if plan.mode == "fully_async":
            clock.record("stop_producer", plan.num_rollout)
            await backend.stop_producer()
