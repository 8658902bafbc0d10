"""The synchronous driver loop: placement → RolloutManager → train actors → rollout/train per rollout id.

The driver never touches a GPU. Everything that can be wrong with the user's input is checked before
`ray.init` (`preflight`), so a typo costs a second, not a cluster start-up.
"""

from __future__ import annotations

import logging
import os
import time
from argparse import Namespace

from slime.utils.errors import SlimeArgError

logger = logging.getLogger(__name__)


def preflight(args: Namespace) -> int:
    """Validate files before anything starts; returns the number of training prompts (0 when replaying)."""
    from slime.backends.sglang.engine_choice import check_rollout_engine
    from slime.backends.sglang.sglang_config import check_model_references

    check_model_references(args)  # teachers, served reference and reward model exist in --sglang-config
    if args.load_debug_rollout_data:
        first = args.load_debug_rollout_data.format(rollout_id=args.start_rollout_id or 0)
        if not os.path.isfile(first):
            raise SlimeArgError(f"--load-debug-rollout-data: no dump for the first rollout at {first}")
        return 0
    if args.prompt_data is None and not args.disable_rollout_global_dataset:
        raise SlimeArgError("--prompt-data is required (JSONL or parquet of prompts)")
    from slime.rollout.dataset import validate_prompt_data

    num_prompts = validate_prompt_data(args)
    check_rollout_engine(args)  # which servers start (never the simulated ones silently on CUDA); their flags
    return num_prompts


def resolve_num_rollout(args: Namespace, num_prompts: int) -> int:
    if args.num_rollout is not None:
        return args.num_rollout
    if args.load_debug_rollout_data:
        raise SlimeArgError("--load-debug-rollout-data needs --num-rollout (epochs are unknown without a dataset)")
    per_epoch = num_prompts // args.rollout_batch_size
    if per_epoch == 0:
        raise SlimeArgError(
            f"--rollout-batch-size {args.rollout_batch_size} exceeds the {num_prompts} prompts of --prompt-data"
        )
    return per_epoch * args.num_epoch


def _should_save(args: Namespace, rollout_id: int) -> bool:
    """Every --save-interval rollouts, and always after the last one (as slime does)."""
    last = rollout_id == args.num_rollout - 1
    return last or bool(args.save_interval and (rollout_id + 1) % args.save_interval == 0)


def train(args: Namespace) -> dict:
    """Run the whole job; returns a summary (per-rollout train hashes, server info) for scripts and tests."""
    from slime.ray.placement import init_ray

    t_start = time.perf_counter()
    num_prompts = preflight(args)
    args.num_rollout = resolve_num_rollout(args, num_prompts)
    startup = {"startup/preflight": time.perf_counter() - t_start}  # where the fixed cost of a run goes
    init_ray(args)
    startup["startup/ray_init"] = time.perf_counter() - t_start - startup["startup/preflight"]
    if args.fully_async or args.one_step_ahead:  # generation overlaps training: slime/async_train.py
        from slime.async_train import train_async

        return train_async(args, startup, t_start)

    import ray

    from slime.utils import checkpoint_dirs as checkpoint
    from slime.backends.megatron.roles import role_args
    from slime.ray.placement import create_placement_group
    from slime.ray.rollout_manager import RolloutManager
    from slime.ray.run_end import shut_down, write_summary
    from slime.ray.run_start import report_startup, servers_and_trainer
    from slime.ray.train_actor import TrainModels
    from slime.utils.tracking import STEP_PHASES, Tracker, progress, step_line

    actor_args = role_args(args, "actor")  # the actor's checkpoint dirs (--megatron-config may override them)
    manager = None
    tracker = Tracker(args)
    summary: dict = {"hashes": {}, "metrics": {}, "server_info": None, "train_status": None}
    try:
        placement = create_placement_group(args)
        offload_rollout = args.offload_rollout and not (args.debug_train_only or args.debug_rollout_only)
        manager = ray.remote(RolloutManager).options(num_cpus=0.1, num_gpus=0).remote(args, placement)
        resume = checkpoint.find_checkpoint(actor_args.load)

        def build_trainer() -> tuple[TrainModels, int]:
            models = TrainModels(args, placement)  # the actor, and PPO's critic on the same GPUs
            return models, models.init(resume)

        summary["server_info"], (actors, start), timings = servers_and_trainer(
            args, manager, build_trainer, offload_rollout=offload_rollout
        )
        startup.update(timings)
        if resume is not None:
            ray.get(manager.load.remote(*resume))  # data source, its buffer, carried-over groups
            summary["resumed_from"] = resume[0]
            if args.start_rollout_id is None:
                start = resume[0] + 1  # also under --debug-rollout-only, where no trainer loads anything
        ray.get(manager.set_train_parallel_config.remote(actors.parallel_config()))
        summary["train_status"] = actors.status()
        sync_weights = not (args.debug_rollout_only or args.debug_train_only)

        def update_weights(version: int) -> dict[str, float]:
            t0 = time.perf_counter()
            engines = ray.get(manager.lock_weight_sync_engines.remote())
            try:
                out = actors.update_weights(engines, version)
            finally:
                ray.get(manager.unlock_weight_sync_engines.remote())
            return {**out, "time/weight_sync": time.perf_counter() - t0}

        def sync_and_onload(version: int | None) -> dict[str, float]:
            """Colocated order: weights memory back, weights in, then KV cache and CUDA graphs."""
            t0 = time.perf_counter()
            if offload_rollout:
                ray.get(manager.onload.remote(["weights"]))
            t1 = time.perf_counter()
            out = update_weights(version) if version is not None else {}
            t2 = time.perf_counter()
            if offload_rollout:
                ray.get(manager.onload.remote(["kv_cache", "cuda_graph"]))
                out["time/engine_resume"] = (t1 - t0) + (time.perf_counter() - t2)
            return out

        def save(rollout_id: int) -> None:
            tmp = checkpoint.begin_save(actor_args.save, rollout_id)
            actors.save(tmp, rollout_id)
            ray.get(manager.save.remote(rollout_id, tmp))
            checkpoint.finish_save(actor_args.save, rollout_id, {"rollout_id": rollout_id, "time": time.time()})

        last_eval: dict[str, float] = {}

        def evaluate(rollout_id: int) -> float:
            t0 = time.perf_counter()
            out = ray.get(manager.eval.remote(rollout_id))
            if out:
                tracker.log(out, step=rollout_id, kind="eval")
                last_eval.update(out)
            return time.perf_counter() - t0

        if sync_weights:
            t0 = time.perf_counter()
            sync_and_onload(start)  # engines serve exactly the trainer's weights from the first rollout on
            startup["startup/first_weight_sync"] = time.perf_counter() - t0
        summary["startup"] = report_startup(tracker, startup, t_start, start)
        with progress(args.num_rollout, "rollout", start=start) as bar:
            for rollout_id in range(start, args.num_rollout):
                t_step = time.perf_counter()
                metrics: dict[str, float] = {}
                if args.eval_interval and rollout_id % args.eval_interval == 0:
                    if rollout_id > start or not args.skip_eval_before_train:
                        metrics["time/eval"] = evaluate(rollout_id)
                t0 = time.perf_counter()
                rank_refs, rollout_metrics = ray.get(manager.generate.remote(rollout_id))
                metrics["time/rollout"] = time.perf_counter() - t0
                if rollout_metrics is not None:
                    tracker.log(rollout_metrics, step=rollout_id, kind="rollout")
                if offload_rollout:
                    t0 = time.perf_counter()
                    ray.get(manager.offload.remote())
                    metrics["time/engine_release"] = time.perf_counter() - t0
                sync_due = sync_weights and (rollout_id + 1) % args.update_weights_interval == 0
                if rank_refs is not None:
                    t0 = time.perf_counter()
                    # a sleeping trainer keeps its weights on the GPU for the sync that follows (train_actor.py)
                    hashes, train_metrics = actors.train(rollout_id, rank_refs, keep_weights=sync_due)
                    summary["hashes"][rollout_id] = hashes
                    metrics.update(train_metrics)
                    metrics["time/train_total"] = time.perf_counter() - t0
                if actor_args.save and _should_save(actor_args, rollout_id):
                    t1 = time.perf_counter()
                    save(rollout_id)
                    metrics["time/save"] = time.perf_counter() - t1
                if actor_args.save_hf and _should_save(actor_args, rollout_id):
                    t1 = time.perf_counter()
                    actors.save_hf(actor_args.save_hf.format(rollout_id=rollout_id))
                    metrics["time/save_hf"] = time.perf_counter() - t1
                if sync_weights and rank_refs is not None:
                    metrics.update(sync_and_onload(rollout_id + 1 if sync_due else None))
                metrics["time/step"] = time.perf_counter() - t_step
                metrics["time/unaccounted"] = metrics["time/step"] - sum(metrics.get(k, 0.0) for k in STEP_PHASES)
                summary["metrics"][rollout_id] = metrics
                tracker.log(metrics, step=rollout_id, kind="train")
                bar.update(1, detail=step_line({**(rollout_metrics or {}), **metrics}, last_eval))
        summary["train_status"] = actors.status()
        summary["offload_events"] = actors.offload_events()
        if args.eval_interval:
            evaluate(args.num_rollout)
            logger.info("final eval: %s", step_line({}, last_eval))
    finally:
        shut_down(manager, tracker)
    summary_path = write_summary(args, summary)
    logger.info("done: %d rollouts; summary in %s", len(summary["hashes"]) or args.num_rollout, summary_path)
    return summary
