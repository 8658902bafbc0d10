"""Batch-size and micro-batching flags: groups per optimizer step, tokens per micro-batch, DP balance."""

from __future__ import annotations

import argparse

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
