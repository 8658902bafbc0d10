"""A training run on Ray, in every schedule: placement group → RolloutManager → train group → resume → the loop.

`slime/train.py` calls `run` once Ray is up. The set-up is the same for the synchronous, one-step-ahead and
fully-async schedules (which flags each refuses: `slime/arguments.py:check_schedule_combinations`); the loop
itself (`slime/scheduling/loop.py`) decides the order of events and `RayLoopBackend` turns them into calls.
"""

from __future__ import annotations

import asyncio
import logging
from argparse import Namespace

import ray

from slime.backends.megatron.roles import role_args
from slime.ray.actor_faults import fault_of
from slime.ray.loop_backend import RayLoopBackend
from slime.ray.placement import create_placement_group
from slime.ray.rollout_manager import RolloutManager
from slime.ray.run_end import shut_down, write_summary
from slime.ray.run_start import servers_and_trainer
from slime.ray.train_group import TrainGroup
from slime.scheduling.loop import LoopPlan, run_loop
from slime.utils import checkpoint_dirs
from slime.utils.tracking import Tracker, progress, step_line

logger = logging.getLogger(__name__)


def run(args: Namespace, startup: dict[str, float], t_start: float) -> dict:
    """Run the job on the Ray cluster `init_ray` started or joined; returns the summary (per-rollout train
    hashes and metrics, the loop's events, server info, the actor's offload events) for scripts and tests."""
    actor_args = role_args(args, "actor")  # the actor's checkpoint dirs (--megatron-config may override them)
    manager = trainer = None
    tracker = Tracker(args)
    summary: dict = {"hashes": {}, "metrics": {}, "events": [], "server_info": None, "train_status": None}
    try:
        placement = create_placement_group(args)
        manager = ray.remote(RolloutManager).options(num_cpus=0.1, num_gpus=0).remote(args, placement)
        resume = checkpoint_dirs.find_checkpoint(actor_args.load)

        def build_trainer() -> tuple[TrainGroup, int]:
            group = TrainGroup(args, placement)  # the actor, and PPO's critic on the same GPUs
            return group, group.init(resume)

        summary["server_info"], (trainer, start), timings = servers_and_trainer(args, manager, build_trainer)
        startup.update(timings)
        if resume is not None:
            ray.get(manager.load.remote(*resume))  # data source, buffers, carry-over, in-flight and pending groups
            summary["resumed_from"] = resume[0]
            if args.start_rollout_id is None:
                start = resume[0] + 1  # also under --debug-rollout-only, where no trainer loads anything
        ray.get(manager.set_train_parallel_config.remote(trainer.parallel_config()))
        summary["train_status"] = trainer.status()
        plan = LoopPlan.from_args(actor_args, start)
        with progress(args.num_rollout, "rollout", start=start) as bar:
            backend = RayLoopBackend(
                actor_args, manager, trainer, tracker, summary, bar, startup=startup, t_start=t_start
            )
            asyncio.run(run_loop(plan, backend, lambda kind, ident: summary["events"].append((kind, ident))))
        summary["train_status"] = trainer.status()
        summary["offload_events"] = trainer.offload_events()
        if backend.last_eval:
            logger.info("final eval: %s", step_line({}, backend.last_eval))
    except Exception as e:
        fault = fault_of(e, trainer, manager, summary["events"], actor_args.save)
        if fault is None:
            raise
        fault.write(args.metrics_dir)  # for the restart supervisor (slime/ray/restarts.py)
        if fault.actor == "rollout_manager":
            manager = None  # dead or hung: it cannot dispose of its servers; they go with ray.shutdown
        raise fault from e
    finally:
        shut_down(manager, tracker)
    summary_path = write_summary(args, summary)
    logger.info("done: %d rollouts (%s); summary in %s", len(summary["metrics"]), plan.mode, summary_path)
    return summary
