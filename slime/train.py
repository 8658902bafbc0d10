"""`slime train`: check the input, start Ray, run (`slime/ray/run.py`, the one loop of every schedule).

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
    from slime.backends.megatron.checkpoint_checks import check_checkpoints
    from slime.backends.sglang.engine_choice import check_rollout_engine
    from slime.backends.sglang.sglang_config import check_model_references, resolve_sglang_config
    from slime.rollout.arguments import DEFAULT_DATA_SOURCE, DEFAULT_ROLLOUT_FN
    from slime.utils.hook_checks import check_hooks

    resolve_sglang_config(args)  # the whole --sglang-config file (or the flags' topology), whatever flags name in it
    check_model_references(args)  # teachers, served reference and reward model exist in --sglang-config
    num_prompts = 0
    if args.load_debug_rollout_data:
        first = args.load_debug_rollout_data.format(rollout_id=args.start_rollout_id or 0)
        if not os.path.isfile(first):
            raise SlimeArgError(f"--load-debug-rollout-data: no dump for the first rollout at {first}")
    else:
        if args.prompt_data is None and not args.disable_rollout_global_dataset:
            raise SlimeArgError("--prompt-data is required (JSONL or parquet of prompts)")
        from slime.rollout.dataset import validate_prompt_data

        num_prompts = validate_prompt_data(args)
    check_hooks(args, builtin=(DEFAULT_ROLLOUT_FN, DEFAULT_DATA_SOURCE))  # every other hook imports and fits its call
    check_checkpoints(args)  # every checkpoint a train rank builds: its architecture, in this layout
    if not args.load_debug_rollout_data:
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


def train(args: Namespace) -> dict:
    """Run the whole job; returns a summary (per-rollout train hashes, server info) for scripts and tests."""
    from slime.ray.placement import init_ray
    from slime.ray.run import run

    t_start = time.perf_counter()
    num_prompts = preflight(args)
    args.num_rollout = resolve_num_rollout(args, num_prompts)
    startup = {"startup/preflight": time.perf_counter() - t_start}  # where the fixed cost of a run goes
    init_ray(args)
    startup["startup/ray_init"] = time.perf_counter() - t_start - startup["startup/preflight"]
    return run(args, startup, t_start)
