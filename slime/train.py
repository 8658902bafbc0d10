"""The synchronous driver loop (spec §1.3): placement → RolloutManager → train actors → rollout/train per id.

The driver never touches a GPU. Everything that can be wrong with the user's input is checked before
`ray.init` (`preflight`), so a typo costs a second, not a cluster start-up.
"""

from __future__ import annotations

import json
import logging
import os
from argparse import Namespace

from slime.utils.errors import SlimeArgError

logger = logging.getLogger(__name__)


def preflight(args: Namespace) -> int:
    """Validate files before anything starts; returns the number of training prompts (0 when replaying)."""
    if args.load_debug_rollout_data:
        first = args.load_debug_rollout_data.format(rollout_id=args.start_rollout_id or 0)
        if not os.path.isfile(first):
            raise SlimeArgError(f"--load-debug-rollout-data: no dump for the first rollout at {first}")
        return 0
    if args.prompt_data is None and not args.disable_rollout_global_dataset:
        raise SlimeArgError("--prompt-data is required (JSONL or parquet of prompts)")
    from slime.rollout.dataset import validate_prompt_data

    return validate_prompt_data(args)


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


def train(args: Namespace) -> dict:
    """Run the whole job; returns a summary (per-rollout train hashes, server info) for scripts and tests."""
    num_prompts = preflight(args)
    args.num_rollout = resolve_num_rollout(args, num_prompts)

    import ray

    from slime.ray.placement import create_placement_group, init_ray
    from slime.ray.rollout_manager import RolloutManager
    from slime.ray.train_actor import RayTrainGroup
    from slime.utils.tracking import Tracker, progress

    init_ray(args)
    manager = None
    tracker = Tracker(args)
    summary: dict = {"hashes": {}, "server_info": None, "train_status": None}
    try:
        placement = create_placement_group(args)
        manager = ray.remote(RolloutManager).options(num_cpus=0.1, num_gpus=0).remote(args, placement)
        summary["server_info"] = ray.get(manager.server_info.remote())
        os.makedirs(args.metrics_dir, exist_ok=True)
        with open(os.path.join(args.metrics_dir, "servers.json"), "w") as f:
            json.dump(summary["server_info"], f)  # lets operators (and tests) find the processes while running
        actors = RayTrainGroup(args, placement)
        start = actors.init()
        ray.get(manager.set_train_parallel_config.remote(actors.parallel_config()))
        summary["train_status"] = actors.status()
        with progress(args.num_rollout, "rollouts", start=start) as bar:
            for rollout_id in range(start, args.num_rollout):
                if args.eval_interval and (rollout_id % args.eval_interval == 0) and not args.skip_eval_before_train:
                    ray.get(manager.eval.remote(rollout_id))
                rank_refs = ray.get(manager.generate.remote(rollout_id))
                if rank_refs is not None:
                    hashes = actors.train(rollout_id, rank_refs)
                    summary["hashes"][rollout_id] = hashes
                    tracker.log({"train/data_hash_rank0": int(hashes[0][:8], 16)}, step=rollout_id, kind="train")
                bar.update(1)
        summary["train_status"] = actors.status()
        if args.eval_interval:
            ray.get(manager.eval.remote(args.num_rollout))
    finally:
        if manager is not None:
            try:
                ray.get(manager.dispose.remote(), timeout=120)
            except Exception:  # noqa: BLE001 - shutting down anyway
                logger.warning("rollout manager dispose failed", exc_info=True)
        tracker.close()
        ray.shutdown()
    summary_path = os.path.join(args.metrics_dir, "summary.json")
    with open(summary_path, "w") as f:
        json.dump(summary, f, indent=1, default=str)
    logger.info("done: %d rollouts; summary in %s", len(summary["hashes"]) or args.num_rollout, summary_path)
    return summary
