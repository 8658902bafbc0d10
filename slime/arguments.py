"""The one flat `args` namespace: every room declares its flags, this module composes them (the composition root).

Why one namespace: every hook (`--*-path`) receives `args` and may read anything, as in slime. The parser is
the one place a default lives: production code reads `args.x` and never repeats a default in a getattr
fallback. User mistakes raise `SlimeArgError` (one line naming the flag and the fix) in the driver, before `ray.init`.

Flags of features that are not built yet stay in the parser (slime's scripts pass them) but are refused when
set: each room lists them in its `UNSUPPORTED` table.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import yaml

from slime.agent.arguments import add_agent_arguments, resolve_agent_args
from slime.algorithms import arguments as algorithm_flags
from slime.backends.megatron import arguments as megatron_flags
from slime.backends.megatron.roles import resolve_roles
from slime.backends.sglang.arguments import add_rollout_engine_arguments, validate_rollout_engine_args
from slime.backends.sglang.flags import add_router_arguments, add_sglang_arguments, check_unknown_prefixed
from slime.ray.arguments import add_cluster_arguments, validate_cluster_args
from slime.rollout import arguments as rollout_flags
from slime.rollout.arguments import DEFAULT_ROLLOUT_FN
from slime.scheduling.arguments import (
    add_async_arguments,
    add_batching_arguments,
    validate_async_args,
    validate_batching_args,
)
from slime.utils.errors import SlimeArgError

logger = logging.getLogger(__name__)

# Attributes set after parsing (not flags): what the driver learns at run time.
DERIVED = {
    "world_size": "train ranks (--actor-num-nodes x --actor-num-gpus-per-node)",
    "sglang_model_routers": "{model name: router URL}, set once the routers are up",
    "role_overrides": "{role: {dest: value}} from --megatron-config / --critic-load / --critic-save",
    "sglang_version": "the SGLang release the servers run, learnt by preflight (None: simulated or external)",
}


def unsupported_flags() -> dict[str, str]:
    """dest -> why, for every flag that is parsed but refused when set."""
    return {**rollout_flags.UNSUPPORTED, **algorithm_flags.UNSUPPORTED, **megatron_flags.UNSUPPORTED}


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of printing usage and exiting, so errors become one clear line."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise SlimeArgError(message)


def _add_debug_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("debug / observability")
    g.add_argument("--debug-rollout-only", action="store_true", help="inference only: no training process groups")
    g.add_argument("--debug-train-only", action="store_true", help="training only: no engine, no router")
    g.add_argument("--save-debug-rollout-data", default=None, help="path template with {rollout_id}")
    g.add_argument("--load-debug-rollout-data", default=None, help="path template; implies --debug-train-only")
    g.add_argument("--load-debug-rollout-data-subsample", type=float, default=None)
    g.add_argument(
        "--dump-details", default=None, help="directory; sets --save-debug-rollout-data to DIR/rollout_data/"
    )
    g.add_argument("--metrics-dir", default="runs/latest", help="metrics.jsonl and TensorBoard events go here")
    g.add_argument("--use-tensorboard", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument(
        "--use-wandb", action="store_true", help="log the same metrics to Weights & Biases (args as config)"
    )
    g.add_argument("--wandb-project", default="slime")
    g.add_argument("--wandb-group", default=None, help="W&B group of the run (e.g. one experiment's seeds)")
    g.add_argument("--wandb-mode", choices=["online", "offline"], default="online", help="offline: no network")
    g.add_argument(
        "--log-level",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        default="INFO",
        help="console level of the driver; Ray actors print WARNING and above unless DEBUG (their full logs go "
        "to METRICS_DIR/logs/)",
    )
    g.add_argument("--custom-config-path", default=None, help="YAML of flat key: value pairs set onto args")
    g.add_argument(
        "--custom-rollout-log-function-path",
        default=None,
        help="fn(rollout_id, args, samples, rollout_extra_metrics, rollout_time); True skips the default logging",
    )
    g.add_argument(
        "--custom-eval-rollout-log-function-path",
        default=None,
        help="fn(rollout_id, args, data, extra_metrics); True skips the default eval logging",
    )


def build_parser(
    add_custom_arguments: Callable[[argparse.ArgumentParser], None] | None = None, argv: Sequence[str] | None = None
) -> _Parser:
    """The full parser; `add_custom_arguments` runs first so user flags may pre-empt slime names (as in slime).
    `argv`: the command line to be parsed, read for an import-path `--rollout-engine` plugin's own flags."""
    p = _Parser(prog="slime train", allow_abbrev=False, description="RL post-training with Megatron-core + SGLang")
    if add_custom_arguments is not None:
        add_custom_arguments(p)
    add_cluster_arguments(p)
    add_rollout_engine_arguments(p, None if argv is None else list(argv))
    rollout_flags.add_rollout_arguments(p)
    add_batching_arguments(p)
    add_async_arguments(p)
    algorithm_flags.add_algorithm_arguments(p)
    _add_debug_arguments(p)
    megatron_flags.add_megatron_arguments(p)
    add_agent_arguments(p)
    add_sglang_arguments(p)
    add_router_arguments(p)
    return p


def reject_unknown(parser: argparse.ArgumentParser, unknown: list[str]) -> None:
    flags = [u for u in unknown if u.startswith("--")]
    check_unknown_prefixed(flags)  # one-line errors for --sglang-* / --router-* typos, against the snapshots
    if flags:
        known = [s for a in parser._actions for s in a.option_strings]
        name = flags[0].split("=", 1)[0]
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"; did you mean {close[0]}?" if close else "; see 'slime train --help'"
        raise SlimeArgError(f"unknown flag {name}{hint}")
    if unknown:
        raise SlimeArgError(f"unexpected argument {unknown[0]!r} (values must follow their flag)")


def apply_custom_config(args: argparse.Namespace, path: str) -> None:
    """`--custom-config-path`: flat `key: value` YAML set onto args (overrides the CLI, logged)."""
    if not os.path.isfile(path):
        raise SlimeArgError(f"--custom-config-path: file not found: {path}")
    with open(path) as f:
        try:
            data = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f":{mark.line + 1}" if mark is not None else ""
            raise SlimeArgError(
                f"--custom-config-path {path}{where}: invalid YAML ({getattr(e, 'problem', e)})"
            ) from e
    if not isinstance(data, dict):
        raise SlimeArgError(f"--custom-config-path {path}: expected a mapping of flag names to values")
    for key, value in data.items():
        dest = str(key).replace("-", "_")
        if dest not in vars(args):
            close = difflib.get_close_matches(dest, vars(args), n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise SlimeArgError(f"--custom-config-path {path}: unknown key {key!r}{hint}")
        logger.info("custom config %s: %s = %r (was %r)", path, dest, value, vars(args)[dest])
        setattr(args, dest, value)


def parse_args(
    argv: Sequence[str] | None = None,
    add_custom_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
) -> argparse.Namespace:
    parser = build_parser(add_custom_arguments, argv)
    args, unknown = parser.parse_known_args(argv)
    reject_unknown(parser, unknown)
    if args.custom_config_path:
        apply_custom_config(args, args.custom_config_path)
    validate_args(args, parser)
    return args


def refuse_unsupported(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    for dest, why in unsupported_flags().items():
        if vars(args)[dest] != parser.get_default(dest):
            raise SlimeArgError(f"--{dest.replace('_', '-')} is not supported yet: {why}")


def validate_args(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> None:
    """slime's cross-flag rules, room by room; derived values are written back onto args (as slime does)."""
    parser = parser or build_parser()
    refuse_unsupported(args, parser)
    if args.dump_details:
        args.save_debug_rollout_data = args.save_debug_rollout_data or os.path.join(
            args.dump_details, "rollout_data", "{rollout_id}.pt"
        )
    if args.load_debug_rollout_data:
        args.debug_train_only = True
    if args.debug_rollout_only and args.debug_train_only:
        raise SlimeArgError(
            "--debug-rollout-only and --debug-train-only (or --load-debug-rollout-data) exclude each other; pick one"
        )
    rollout_flags.validate_rollout_args(args)
    validate_batching_args(args)
    algorithm_flags.validate_algorithm_args(args)
    if args.advantage_estimator == "ppo" and args.offload_train is None and not args.debug_rollout_only:
        args.offload_train = True  # actor and critic time-share each GPU: one sleeps while the other trains
    validate_cluster_args(args)
    megatron_flags.validate_megatron_args(args)
    resolve_roles(args, parser)
    validate_rollout_engine_args(args)
    validate_async_args(args)
    check_schedule_combinations(args)
    if not args.debug_train_only and args.hf_checkpoint is None:
        raise SlimeArgError("--hf-checkpoint is required (tokenizer and initial weights of the rollout engines)")
    if args.hf_checkpoint is not None and not os.path.isfile(os.path.join(args.hf_checkpoint, "config.json")):
        raise SlimeArgError(f"--hf-checkpoint {args.hf_checkpoint}: no config.json there (expected an HF model dir)")
    resolve_agent_args(args)
    args.sglang_model_routers = {}
    args.sglang_version = None


def check_schedule_combinations(args: argparse.Namespace) -> None:
    """What the async schedules (scheduling room) exclude in the cluster, debug and rollout rooms."""
    if not (args.fully_async or args.one_step_ahead):
        return
    flag = "--fully-async" if args.fully_async else "--one-step-ahead"
    if args.colocate:
        raise SlimeArgError(
            f"{flag} overlaps generation and training, which --colocate time-shares on the same GPUs; "
            "drop --colocate and give the engines their own --rollout-num-gpus"
        )
    if args.offload_rollout:
        raise SlimeArgError(
            f"{flag} generates while the trainer trains; --offload-rollout would release the engines' memory then"
        )
    if args.debug_rollout_only or args.debug_train_only:
        raise SlimeArgError(f"{flag} needs both engines and trainer; the debug modes run one of them")
    if not args.fully_async:
        return
    if args.rollout_function_path != DEFAULT_ROLLOUT_FN:
        raise SlimeArgError(
            "--fully-async generates with its own producer and cannot call a custom --rollout-function-path; "
            "customise per sample with --custom-generate-function-path"
        )
    if args.partial_rollout:
        raise SlimeArgError(
            "--fully-async always resumes interrupted groups (it is the partial-rollout path); drop --partial-rollout"
        )
    if args.over_sampling_batch_size not in (None, args.rollout_batch_size):
        raise SlimeArgError("--over-sampling-batch-size has no meaning with --fully-async (nothing is aborted)")
    if args.rollout_all_samples_process_path:
        raise SlimeArgError(
            "--rollout-all-samples-process-path sees one rollout's generated groups; --fully-async has no "
            "rollouts (use --rollout-sample-filter-path, applied to each consumed batch)"
        )


def default_args(**overrides: Any) -> argparse.Namespace:
    """The parser's defaults with `overrides` set, unvalidated: for tests and for calling hooks from a notebook.

    Only flag names (dests) and the DERIVED attributes may be overridden, so a misspelt name fails here
    instead of silently adding an attribute no code reads.
    """
    args = build_parser().parse_args([])
    args.world_size = 1
    args.sglang_model_routers = {}
    args.role_overrides = {}
    args.sglang_version = None
    for key, value in overrides.items():
        if key not in vars(args):
            close = difflib.get_close_matches(key, vars(args), n=1)
            raise AttributeError(
                f"default_args: {key!r} is not a flag dest" + (f"; did you mean {close[0]}?" if close else "")
            )
        setattr(args, key, value)
    return args
