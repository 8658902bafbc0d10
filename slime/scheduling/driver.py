"""The order of a training run's events in each scheduling mode, written once against a small backend protocol.

The same loop drives the Ray run (`slime/async_train.py`) and the scheduling simulator (`sim/scheduling`), so what
the simulator measures is the order the real run follows. `sync` is the order of `slime/train.py`'s loop (a test
runs that loop with recording stand-ins for Ray and compares):

- **sync**: per rollout: eval (when due) → rollout → train data → train → save (when due) → weight sync (every
  `--update-weights-interval` rollouts). Generation and training alternate.
- **one_step** (`--one-step-ahead`): rollout k+1 is launched before step k trains, so generation overlaps
  training and every batch is one weight version old (up to `--update-weights-interval` with a longer interval).
  Before a weight sync the run waits for the rollout in flight, so weights never change under a rollout.
- **fully_async** (`--fully-async`): a producer generates continuously (`slime/scheduling/fully_async.py`); each
  step consumes a batch within the staleness bound; a weight sync pauses generation, loads and continues.

Events are recorded as `(kind, id)`: `sync` carries the weight version pushed, every other kind the rollout id.
"""

from __future__ import annotations

import asyncio
from argparse import Namespace
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

MODES = ("sync", "one_step", "fully_async")


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
    save: bool = False  # a checkpoint (--save) or an HF export (--save-hf) is written
    save_interval: int | None = None
    eval_interval: int | None = None
    skip_eval_before_train: bool = False

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")

    @classmethod
    def from_args(cls, args: Namespace, start: int) -> LoopPlan:
        return cls(
            mode=mode_from_args(args),
            start=start,
            num_rollout=args.num_rollout,
            update_weights_interval=args.update_weights_interval,
            save=bool(args.save or args.save_hf),
            save_interval=args.save_interval,
            eval_interval=args.eval_interval,
            skip_eval_before_train=args.skip_eval_before_train,
        )

    def eval_due(self, rollout_id: int) -> bool:
        if not self.eval_interval or rollout_id % self.eval_interval:
            return False
        return rollout_id > self.start or not self.skip_eval_before_train

    def save_due(self, rollout_id: int) -> bool:
        """Every --save-interval rollouts and always after the last one (as slime does)."""
        if not self.save:
            return False
        last = rollout_id == self.num_rollout - 1
        return last or bool(self.save_interval and (rollout_id + 1) % self.save_interval == 0)

    def sync_due(self, rollout_id: int) -> bool:
        return (rollout_id + 1) % self.update_weights_interval == 0


class LoopBackend(Protocol):
    """What the loop asks of a run. `rollout` generates a rollout and keeps it; `train_data` turns the kept
    rollout into the trainer's batch (two calls, so the one-step loop can convert rollout k, whose carry-over
    and checkpoint state come first, before it launches rollout k+1)."""

    async def evaluate(self, rollout_id: int) -> None: ...

    async def rollout(self, rollout_id: int) -> None: ...

    async def train_data(self, rollout_id: int) -> Any: ...

    async def start_producer(self, rollout_id: int) -> None: ...

    async def consume(self, rollout_id: int) -> Any: ...

    async def stop_producer(self) -> None: ...

    async def train(self, rollout_id: int, batch: Any) -> None: ...

    async def save(self, rollout_id: int) -> None: ...

    async def sync_weights(self, version: int) -> None: ...

    async def step_done(self, rollout_id: int) -> None:
        """Step `rollout_id` is over (trained, saved and synced as due): a place to log it."""


Recorder = Callable[[str, int], None]


async def run_loop(plan: LoopPlan, backend: LoopBackend, record: Recorder | None = None) -> None:
    """Run rollouts `plan.start .. plan.num_rollout - 1` in the plan's mode."""

    def note(kind: str, ident: int) -> None:
        if record is not None:
            record(kind, ident)

    async def sync(version: int) -> None:
        note("sync", version)
        await backend.sync_weights(version)

    async def after_train(rollout_id: int) -> None:
        if plan.save_due(rollout_id):
            note("save", rollout_id)
            await backend.save(rollout_id)

    async def evaluate(rollout_id: int) -> None:
        note("eval", rollout_id)
        await backend.evaluate(rollout_id)

    async def launch(rollout_id: int) -> asyncio.Task:
        note("rollout", rollout_id)
        return asyncio.ensure_future(backend.rollout(rollout_id))

    async def take(rollout_id: int, pending: asyncio.Task) -> Any:
        await pending
        note("train_data", rollout_id)
        return await backend.train_data(rollout_id)

    async def train(rollout_id: int, batch: Any) -> None:
        note("train", rollout_id)
        await backend.train(rollout_id, batch)

    await sync(plan.start)  # the engines serve exactly the trainer's weights from the first rollout on
    if plan.mode == "fully_async":
        note("start_producer", plan.start)
        await backend.start_producer(plan.start)
    pending: asyncio.Task | None = None
    try:
        for rollout_id in range(plan.start, plan.num_rollout):
            if plan.eval_due(rollout_id):
                await evaluate(rollout_id)
            if plan.mode == "fully_async":
                note("consume", rollout_id)
                batch = await backend.consume(rollout_id)
            else:
                if pending is None:
                    pending = await launch(rollout_id)
                batch = await take(rollout_id, pending)
                pending = None
                if plan.mode == "one_step" and rollout_id + 1 < plan.num_rollout:
                    pending = await launch(rollout_id + 1)
            await train(rollout_id, batch)
            await after_train(rollout_id)
            if plan.sync_due(rollout_id):
                if pending is not None:
                    await pending  # weights never change under a rollout of the one-step loop
                await sync(rollout_id + 1)
            await backend.step_done(rollout_id)
        if plan.eval_interval:
            await evaluate(plan.num_rollout)
    finally:
        if pending is not None and not pending.done():
            pending.cancel()
            await asyncio.gather(pending, return_exceptions=True)
        if plan.mode == "fully_async":
            note("stop_producer", plan.num_rollout)
            await backend.stop_producer()
