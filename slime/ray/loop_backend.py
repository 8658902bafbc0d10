"""The one loop's events on Ray (`slime/scheduling/loop.py`): calls on the RolloutManager actor and the train group.

Generation may overlap training (one-step-ahead, fully async), so the loop awaits the manager's object refs on
an event loop and runs the blocking train-group calls in a worker thread. What each event does here:

- rollout, train_data: `RolloutManager.rollout`, `.train_data`; start_producer, consume, stop_producer: the
  fully-async producer's, on the manager;
- release_engines, resume_engine_weights, resume_engine_cache: `RolloutManager.offload`, `.onload(["weights"])`,
  `.onload(["kv_cache", "cuda_graph"])`;
- train, save, save_hf: `TrainGroup.train` (critic, then actor), `.save` (between the checkpoint dir's begin and
  finish, with the manager's part), `.save_hf`;
- sync_weights: the engines held (`lock_weight_sync_engines`; fully async pauses generation), the actor's weights
  pushed, the engines let go;
- evaluate: `RolloutManager.eval`; started, step_done: the start-up and each step's metrics logged, the progress
  line moved.
"""

from __future__ import annotations

import asyncio
import logging
import time
from argparse import Namespace
from typing import Any

from slime.ray.actor_faults import await_within
from slime.ray.run_start import report_startup
from slime.ray.train_group import TrainGroup
from slime.scheduling.loop import LoopBackend
from slime.utils import checkpoint_dirs
from slime.utils.tracking import Tracker, step_line

logger = logging.getLogger(__name__)


class RayLoopBackend(LoopBackend):
    def __init__(
        self,
        args: Namespace,
        manager: Any,
        trainer: TrainGroup,
        tracker: Tracker,
        summary: dict,
        bar: Any,
        *,
        startup: dict[str, float],
        t_start: float,
    ) -> None:
        self.args = args  # the actor's: its --save / --save-hf may come from --megatron-config
        self.manager = manager
        self.trainer = trainer
        self.tracker = tracker
        self.summary = summary
        self.bar = bar
        self.startup = startup  # the start-up phases before the loop, and when the driver began
        self.t_start = t_start
        self.last_eval: dict[str, float] = {}
        self._step: dict[str, float] = {}  # this step's metrics from the calls
        self._rollout_metrics: dict[str, float] = {}

    async def _ask(self, method: str, *args: Any) -> Any:
        """A RolloutManager call, bounded by --rollout-hang-timeout (slime/ray/actor_faults.py)."""
        ref = getattr(self.manager, method).remote(*args)
        return await await_within(ref, self.args.rollout_hang_timeout, "rollout_manager", method)

    # ---- rollouts ----------------------------------------------------------------------------------------
    async def rollout(self, rollout_id: int) -> None:
        await self._ask("rollout", rollout_id)

    async def train_data(self, rollout_id: int) -> Any:
        return self._received(rollout_id, *await self._ask("train_data", rollout_id))

    async def start_producer(self, rollout_id: int) -> None:
        await self._ask("start_producer", rollout_id)

    async def consume(self, rollout_id: int) -> Any:
        return self._received(rollout_id, *await self._ask("consume", rollout_id))

    async def stop_producer(self) -> None:
        self._log_evals(await self._ask("finished_evals", True))  # the background evals still running end first
        await self._ask("stop_producer")

    def _received(self, rollout_id: int, rank_refs: Any, metrics: dict | None) -> Any:
        """The trainer's batch (None under --debug-rollout-only); its rollout metrics are logged now."""
        self._rollout_metrics = metrics or {}
        if metrics is not None:
            self.tracker.log(metrics, step=rollout_id, kind="rollout")
        return rank_refs

    async def evaluate(self, rollout_id: int) -> None:
        """Fully async: the eval starts in the background and its metrics come with a later step."""
        self._log_evals([(rollout_id, await self._ask("eval", rollout_id))])

    def _log_evals(self, evals: list[tuple[int, dict[str, float] | None]]) -> None:
        for rollout_id, out in evals:
            if out:
                self.tracker.log(out, step=rollout_id, kind="eval")
                self.last_eval.update(out)

    # ---- colocated engines -------------------------------------------------------------------------------
    async def release_engines(self) -> None:
        await self._ask("offload")

    async def resume_engine_weights(self) -> None:
        await self._ask("onload", ["weights"])

    async def resume_engine_cache(self) -> None:
        await self._ask("onload", ["kv_cache", "cuda_graph"])

    # ---- training ----------------------------------------------------------------------------------------
    async def train(self, rollout_id: int, batch: Any, keep_weights: bool) -> None:
        if batch is None:  # --debug-rollout-only: nothing trains
            return
        hashes, metrics = await asyncio.to_thread(self.trainer.train, rollout_id, batch, keep_weights)
        self.summary["hashes"][rollout_id] = hashes
        self._step.update(metrics)

    async def save(self, rollout_id: int) -> None:
        root = self.args.save
        tmp = checkpoint_dirs.begin_save(root, rollout_id)
        await asyncio.to_thread(self.trainer.save, tmp, rollout_id)
        await self._ask("save", rollout_id, tmp)  # data source, buffers, carry-over, pending rollouts
        checkpoint_dirs.finish_save(root, rollout_id, {"rollout_id": rollout_id, "time": time.time()})

    async def save_hf(self, rollout_id: int) -> None:
        await asyncio.to_thread(self.trainer.save_hf, self.args.save_hf.format(rollout_id=rollout_id))

    async def sync_weights(self, version: int) -> None:
        """Engines held (fully async: generation paused, requests interrupted), weights pushed, generation
        continues at `version`."""
        engines = await self._ask("lock_weight_sync_engines")
        pushed = None
        try:
            out = await asyncio.to_thread(self.trainer.update_weights, engines, version)
            pushed = version
        finally:
            await self._ask("unlock_weight_sync_engines", pushed)
        self._step.update(out)

    # ---- reporting -----------------------------------------------------------------------------------------
    async def started(self, times: dict[str, float]) -> None:
        """The engines hold the trainer's first weights: log the start-up once."""
        startup = dict(self.startup)
        if "time/weight_sync" in times:  # not in the debug modes, which sync nothing
            startup["startup/first_weight_sync"] = times["time/step"]
        self.summary["startup"] = report_startup(self.tracker, startup, self.t_start, self.bar.n)  # at the start
        self._step = {}  # the first sync's own metrics are not a step's

    async def step_done(self, rollout_id: int, times: dict[str, float]) -> None:
        """Log the step's metrics and move the progress line."""
        if self.args.fully_async:
            self._log_evals(await self._ask("finished_evals"))
        metrics = {**self._step, **times}
        self._step = {}
        self.summary["metrics"][rollout_id] = metrics
        self.tracker.log(metrics, step=rollout_id, kind="train")
        self.bar.update(1, detail=step_line({**self._rollout_metrics, **metrics}, self.last_eval))
