"""Batch-size and micro-batching flags: groups per optimizer step, tokens per micro-batch, DP balance."""

from __future__ import annotations

import argparse

from slime.scheduling.loop import mode_from_args
from slime.utils.errors import SlimeArgError


def add_batching_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("batching")
    g.add_argument("--global-batch-size", type=int, default=None, help="groups (trajectories) per optimizer step")
    g.add_argument("--num-steps-per-rollout", type=int, default=None)
    g.add_argument("--micro-batch-size", type=int, default=1, help="samples per micro-batch (static batching)")
    g.add_argument("--use-dynamic-batch-size", action="store_true", help="micro-batches by --max-tokens-per-gpu")
    g.add_argument("--max-tokens-per-gpu", type=int, default=None)
    g.add_argument(
        "--log-probs-max-tokens-per-gpu",
        type=int,
        default=None,
        help="token budget of the no-grad log-prob passes (π_old, π_ref); default: the training micro-batches",
    )
    g.add_argument(
        "--share-prompt-prefix",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="pack samples of one micro-batch with an identical prompt as prompt + branches (exact; the prompt's "
        "tokens go through the model once instead of once per sample)",
    )
    g.add_argument("--balance-data", action="store_true", help="balance micro-batch tokens over DP ranks")
    g.add_argument(
        "--data-pad-size-multiplier",
        type=int,
        default=128,
        help="pad each packed micro-batch row to a multiple of this (times the TP size with sequence parallel)",
    )
    g.add_argument(
        "--allow-partial-last-step",
        action="store_true",
        help="train groups that do not fill the last step as a smaller step instead of carrying them over",
    )
    g.add_argument("--fan-out-reward", choices=["full", "split"], default="full")


def validate_batching_args(args: argparse.Namespace) -> None:
    """slime's batch-size rules; `global_batch_size` is derived when only the step count is given."""
    groups_per_rollout = args.rollout_batch_size * args.n_samples_per_prompt
    if args.num_steps_per_rollout is not None:
        if args.num_steps_per_rollout <= 0:
            raise SlimeArgError("--num-steps-per-rollout must be > 0")
        gbs = groups_per_rollout // args.num_steps_per_rollout
        if gbs <= 0:
            raise SlimeArgError(
                f"--num-steps-per-rollout {args.num_steps_per_rollout} exceeds the {groups_per_rollout} groups "
                "of a rollout"
            )
        if args.global_batch_size not in (None, gbs):
            raise SlimeArgError(
                f"--global-batch-size {args.global_batch_size} contradicts "
                f"--num-steps-per-rollout {args.num_steps_per_rollout} (which gives {gbs}); drop one of them"
            )
        args.global_batch_size = gbs
    if args.global_batch_size is None:
        args.global_batch_size = groups_per_rollout  # one optimizer step per rollout
    if args.global_batch_size <= 0:
        raise SlimeArgError("--global-batch-size must be > 0")
    if args.use_dynamic_batch_size and args.max_tokens_per_gpu is None:
        raise SlimeArgError("--use-dynamic-batch-size needs --max-tokens-per-gpu N")
    for name in ("micro_batch_size", "data_pad_size_multiplier"):
        if getattr(args, name) < 1:
            raise SlimeArgError(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("max_tokens_per_gpu", "log_probs_max_tokens_per_gpu"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise SlimeArgError(f"--{name.replace('_', '-')} must be >= 1")


# flags that shape the fully-async producer; refused without --fully-async (they would do nothing)
FULLY_ASYNC_ONLY = {
    "async_max_concurrent_samples": None,
    "async_data_buffer_capacity_factor": 2.0,
    "custom_async_data_buffer_path": None,
    "update_weights_in_flight": False,
}


def add_async_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("async training (docs/async.md)")
    g.add_argument(
        "--one-step-ahead",
        action="store_true",
        help="generate rollout k+1 while step k trains (data one weight version old); before each weight sync "
        "the rollout in flight finishes first",
    )
    g.add_argument(
        "--fully-async",
        action="store_true",
        help="a background producer keeps groups in flight and the trainer consumes finished groups from a "
        "bounded buffer; a weight sync pauses generation, loads and continues (interrupted groups resume)",
    )
    g.add_argument(
        "--async-max-concurrent-samples",
        type=int,
        default=FULLY_ASYNC_ONLY["async_max_concurrent_samples"],
        help="samples in flight under --fully-async, floored to whole groups (default: one rollout batch)",
    )
    g.add_argument(
        "--async-data-buffer-capacity-factor",
        type=float,
        default=FULLY_ASYNC_ONLY["async_data_buffer_capacity_factor"],
        help="finished groups the buffer holds, as a multiple of --rollout-batch-size; the producer waits when full",
    )
    g.add_argument(
        "--max-weight-staleness",
        type=int,
        default=None,
        help="largest staleness a trained group may have: trainer weight version at consumption minus the oldest "
        "version among the group's trained tokens; groups over it are handled by --async-unused-samples-handler",
    )
    g.add_argument(
        "--async-unused-samples-handler",
        choices=["retry", "drop", "mask"],
        default="retry",
        help="a group over --max-weight-staleness: retry (its prompts are generated again, once), drop, or mask "
        "(its tokens older than the bound become context and the rest trains; dropped when nothing is left)",
    )
    g.add_argument(
        "--update-weights-in-flight",
        action="store_true",
        help="--fully-async: a weight sync pauses the engines in place (SGLang's pause mode in_place) instead of "
        "aborting their requests; running answers keep their KV cache and continue under the new weights",
    )
    g.add_argument(
        "--custom-async-data-buffer-path",
        default=FULLY_ASYNC_ONLY["custom_async_data_buffer_path"],
        help="class built as Class(args, capacity) replacing the fully-async buffer of finished groups "
        "(members: capacity, __len__, __iter__, put, pop; slime/scheduling/group_buffer.py)",
    )


def inherent_staleness(mode: str, update_weights_interval: int) -> int:
    """The staleness a mode's schedule gives every batch by itself: the bound may not be lower."""
    return update_weights_interval if mode == "one_step" else update_weights_interval - 1


def validate_async_args(args: argparse.Namespace) -> None:
    """This room's own flags; what the schedules exclude in other rooms is refused by the composition root
    (`slime/arguments.py:check_schedule_combinations`)."""
    if args.fully_async and args.one_step_ahead:
        raise SlimeArgError("--fully-async and --one-step-ahead are two different schedules; pick one")
    mode = mode_from_args(args)
    if not args.fully_async:
        for dest, default in FULLY_ASYNC_ONLY.items():
            if getattr(args, dest) != default:
                raise SlimeArgError(f"--{dest.replace('_', '-')} only applies with --fully-async")
    if args.fully_async:
        n = args.n_samples_per_prompt
        if args.async_max_concurrent_samples is not None and args.async_max_concurrent_samples < n:
            raise SlimeArgError(
                f"--async-max-concurrent-samples {args.async_max_concurrent_samples} is less than one group "
                f"(--n-samples-per-prompt {n})"
            )
        if int(args.async_data_buffer_capacity_factor * args.rollout_batch_size) < 1:
            raise SlimeArgError("--async-data-buffer-capacity-factor x --rollout-batch-size must hold >= 1 group")
    k = args.max_weight_staleness
    if k is not None:
        if k < 0:
            raise SlimeArgError("--max-weight-staleness must be >= 0")
        floor = inherent_staleness(mode, args.update_weights_interval)
        if k < floor:
            raise SlimeArgError(
                f"--max-weight-staleness {k} is below the staleness every batch has in this schedule ({floor}: "
                f"{mode.replace('_', '-')} with --update-weights-interval {args.update_weights_interval}); "
                f"raise it to >= {floor}"
            )
