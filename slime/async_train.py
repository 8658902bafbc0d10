"""The driver of `--one-step-ahead` and `--fully-async` runs: the loop of `slime/scheduling/driver.py` on Ray.

`slime/train.py` hands these two modes over before it starts anything. Their set-up is the synchronous one's
minus what they refuse (colocated offload, the debug modes: `slime/scheduling/arguments.py`), and the loop's
events become calls on the RolloutManager and the train actors. Generation overlaps training, so the
driver awaits Ray object refs on an event loop and runs the blocking train-group calls in a worker thread.

What each mode does, its flags and its metrics: docs/async.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from argparse import Namespace
from typing import Any

from slime.ray.run_end import shut_down, write_summary
from slime.scheduling.driver import LoopPlan, run_loop

logger = logging.getLogger(__name__)


class RayLoopBackend:
    """The loop's events as calls on the RolloutManager actor and the train group."""

    def __init__(self, args: Namespace, manager: Any, actors: Any, tracker: Any, summary: dict, bar: Any) -> None:
        self.args = args
        self.manager = manager
        self.actors = actors
        self.tracker = tracker
        self.summary = summary
        self.bar = bar
        self.last_eval: dict[str, float] = {}
        self._step: dict[str, float] = {}
        self._rollout_metrics: dict[str, float] = {}
        self._step_t0 = self._wait_t0 = time.perf_counter()

    # ---- rollouts ----------------------------------------------------------------------------------------
    async def rollout(self, rollout_id: int) -> None:
        await self.manager.rollout.remote(rollout_id)

    async def train_data(self, rollout_id: int) -> Any:
        rank_refs, metrics = await self.manager.train_data.remote(rollout_id)
        return self._received(rollout_id, rank_refs, metrics)

    async def start_producer(self, rollout_id: int) -> None:
        await self.manager.start_producer.remote(rollout_id)

    async def consume(self, rollout_id: int) -> Any:
        rank_refs, metrics = await self.manager.consume.remote(rollout_id)
        return self._received(rollout_id, rank_refs, metrics)

    async def stop_producer(self) -> None:
        await self.manager.stop_producer.remote()

    def _received(self, rollout_id: int, rank_refs: Any, metrics: dict | None) -> Any:
        """The trainer's batch arrived: `time/rollout` is how long the trainer waited for it this step."""
        self._step["time/rollout"] = time.perf_counter() - self._wait_t0
        self._rollout_metrics = metrics or {}
        if metrics is not None:
            self.tracker.log(metrics, step=rollout_id, kind="rollout")
        return rank_refs

    # ---- training ----------------------------------------------------------------------------------------
    async def train(self, rollout_id: int, batch: Any) -> None:
        t0 = time.perf_counter()
        hashes, metrics = await asyncio.to_thread(self.actors.train, rollout_id, batch)
        self.summary["hashes"][rollout_id] = hashes
        self._step.update(metrics)
        self._step["time/train_step"] = time.perf_counter() - t0

    async def save(self, rollout_id: int) -> None:
        from slime.utils import checkpoint_dirs as checkpoint

        t0 = time.perf_counter()
        if self.args.save:
            tmp = checkpoint.begin_save(self.args.save, rollout_id)
            await asyncio.to_thread(self.actors.save, tmp, rollout_id)
            await self.manager.save.remote(rollout_id, tmp)
            checkpoint.finish_save(self.args.save, rollout_id, {"rollout_id": rollout_id, "time": time.time()})
        if self.args.save_hf:
            await asyncio.to_thread(self.actors.save_hf, self.args.save_hf.format(rollout_id=rollout_id))
        self._step["time/save"] = time.perf_counter() - t0

    async def sync_weights(self, version: int) -> None:
        """Engines held (fully async: generation paused, requests interrupted), weights pushed, generation
        continues at `version`. Ends the step whose weights these are."""
        t0 = time.perf_counter()
        engines = await self.manager.lock_weight_sync_engines.remote()
        pushed = None
        try:
            out = await asyncio.to_thread(self.actors.update_weights, engines, version)
            pushed = version
        finally:
            await self.manager.unlock_weight_sync_engines.remote(pushed)
        self._step.update(out)
        self._step["time/weight_sync"] = time.perf_counter() - t0

    async def evaluate(self, rollout_id: int) -> None:
        t0 = time.perf_counter()
        out = await self.manager.eval.remote(rollout_id)
        if out:
            self.tracker.log(out, step=rollout_id, kind="eval")
            self.last_eval.update(out)
        self._step["time/eval"] = time.perf_counter() - t0
        self._wait_t0 = time.perf_counter()

    async def step_done(self, rollout_id: int) -> None:
        """Log the step's train metrics and move the progress line."""
        from slime.utils.tracking import step_line

        now = time.perf_counter()
        metrics = {**self._step, "time/step": now - self._step_t0}
        self._step_t0 = self._wait_t0 = now
        self._step = {}
        self.summary["metrics"][rollout_id] = metrics
        self.tracker.log(metrics, step=rollout_id, kind="train")
        self.bar.update(1, detail=step_line({**self._rollout_metrics, **metrics}, self.last_eval))


def train_async(args: Namespace, startup: dict[str, float], t_start: float) -> dict:
    """Run a one-step-ahead or fully-async job (flags already validated, Ray started by `train`); returns the
    summary as `train` does."""
    import ray

    from slime.utils import checkpoint_dirs as checkpoint
    from slime.ray.placement import create_placement_group
    from slime.ray.rollout_manager import RolloutManager
    from slime.ray.run_start import report_startup, servers_and_trainer
    from slime.ray.train_actor import RayTrainGroup
    from slime.utils.tracking import Tracker, progress, step_line

    manager = None
    tracker = Tracker(args)
    summary: dict = {"hashes": {}, "metrics": {}, "server_info": None, "train_status": None, "events": []}
    try:
        placement = create_placement_group(args)
        manager = ray.remote(RolloutManager).options(num_cpus=0.1, num_gpus=0).remote(args, placement)
        resume = checkpoint.find_checkpoint(args.load)

        def build_trainer() -> tuple[RayTrainGroup, int]:
            group = RayTrainGroup(args, placement)
            return group, group.init(resume[1] if resume else None)

        summary["server_info"], (actors, start), timings = servers_and_trainer(
            args, manager, build_trainer, offload_rollout=False
        )
        startup.update(timings)
        if resume is not None:
            ray.get(manager.load.remote(*resume))  # data source, buffers, in-flight groups, pending rollout
            summary["resumed_from"] = resume[0]
            if args.start_rollout_id is None:
                start = resume[0] + 1
        ray.get(manager.set_train_parallel_config.remote(actors.parallel_config()))
        summary["train_status"] = actors.status()
        summary["startup"] = report_startup(tracker, startup, t_start, start)
        plan = LoopPlan.from_args(args, start)
        with progress(args.num_rollout, "rollout", start=start) as bar:
            backend = RayLoopBackend(args, manager, actors, tracker, summary, bar)

            def record(kind: str, ident: int) -> None:
                summary["events"].append((kind, ident))

            asyncio.run(run_loop(plan, backend, record))
        summary["train_status"] = actors.status()
        if backend.last_eval:
            logger.info("final eval: %s", step_line({}, backend.last_eval))
    finally:
        shut_down(manager, tracker)
    summary_path = write_summary(args, summary)
    logger.info("done: %d rollouts (%s); summary in %s", len(summary["hashes"]), plan.mode, summary_path)
    return summary
