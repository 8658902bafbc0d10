"""One flat `args` namespace with slime's flag names (spec §1.8–1.10) and the Megatron-style flags slime owns.

Why one namespace: every hook (`--*-path`) receives `args` and may read anything, as in slime. User mistakes
raise `SlimeArgError` (one line naming the flag and the fix); the CLI prints it without a traceback, and all
checks here run in the driver before `ray.init`.
"""

from __future__ import annotations

import argparse
import difflib
import json
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import yaml

from slime.utils.errors import SlimeArgError

logger = logging.getLogger(__name__)

DEFAULT_ROLLOUT_FN = "slime.rollout.sglang_rollout.generate_rollout"


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of printing usage and exiting, so errors become one clear line."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise SlimeArgError(message)


def _json_or_none(s: str) -> Any:
    try:
        return json.loads(s)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e.msg})") from e


def _add_cluster(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cluster / placement")
    g.add_argument("--actor-num-nodes", type=int, default=1)
    g.add_argument("--actor-num-gpus-per-node", type=int, default=8)
    g.add_argument("--rollout-num-gpus", type=int, default=None)
    g.add_argument("--rollout-num-gpus-per-engine", type=int, default=1)
    g.add_argument("--num-gpus-per-node", type=int, default=8)
    g.add_argument("--colocate", action="store_true")
    g.add_argument("--offload", action="store_true", help="shorthand for --offload-train --offload-rollout")
    g.add_argument("--offload-train", action=argparse.BooleanOptionalAction, default=None)
    g.add_argument("--offload-rollout", action=argparse.BooleanOptionalAction, default=None)
    g.add_argument("--train-env-vars", type=_json_or_none, default={})
    g.add_argument("--train-backend", choices=["megatron"], default="megatron")
    g.add_argument(
        "--rollout-engine",
        choices=["sglang", "sim", "auto"],
        default="auto",
        help="sglang: real SGLang servers; sim: sim.fake_sglang servers; auto: sglang when installed with CUDA",
    )
    g.add_argument("--sim-engine", choices=["hf", "scripted", "synthetic"], default="hf")
    g.add_argument("--sim-script", default=None, help="rules file for --sim-engine scripted")
    g.add_argument("--sim-synthetic-config", default=None, help="distribution file for --sim-engine synthetic")
    g.add_argument("--sim-request-log-dir", default=None, help="fake engines write request logs here")
    g.add_argument("--ray-address", default=None, help="connect to an existing Ray cluster instead of starting one")


def _add_rollout(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("rollout")
    g.add_argument("--hf-checkpoint", default=None)
    g.add_argument("--model-name", default=None)
    g.add_argument("--rollout-function-path", default=DEFAULT_ROLLOUT_FN)
    g.add_argument("--custom-generate-function-path", default=None)
    g.add_argument("--eval-function-path", default=None)
    g.add_argument("--rollout-temperature", type=float, default=1.0)
    g.add_argument("--rollout-top-p", type=float, default=1.0)
    g.add_argument("--rollout-top-k", type=int, default=-1)
    g.add_argument("--rollout-max-response-len", type=int, default=1024)
    g.add_argument("--rollout-max-context-len", type=int, default=None)
    g.add_argument("--rollout-max-prompt-len", type=int, default=None)
    g.add_argument("--rollout-stop", nargs="+", default=None)
    g.add_argument("--rollout-stop-token-ids", type=int, nargs="+", default=None)
    g.add_argument("--rollout-skip-special-tokens", action="store_true")
    g.add_argument("--rollout-shuffle", action="store_true")
    g.add_argument("--rollout-seed", type=int, default=42)
    g.add_argument("--over-sampling-batch-size", type=int, default=None)
    g.add_argument("--dynamic-sampling-filter-path", default=None)
    g.add_argument("--partial-rollout", action="store_true")
    g.add_argument("--mask-offpolicy-in-partial-rollout", action="store_true")
    g.add_argument("--buffer-filter-path", default=None)
    g.add_argument("--rollout-sample-filter-path", default=None)
    g.add_argument("--rollout-all-samples-process-path", default=None)
    g.add_argument("--rollout-data-postprocess-path", default=None)
    g.add_argument("--rollout-external", action="store_true")
    g.add_argument("--rollout-external-engine-addrs", nargs="+", default=None)
    g.add_argument("--prefill-num-servers", type=int, default=None)
    g.add_argument("--sglang-config", default=None, help="YAML topology of models, server groups and routers")
    g.add_argument("--use-fault-tolerance", action="store_true")
    g.add_argument("--rollout-health-check-interval", type=float, default=30.0)
    g.add_argument("--rollout-health-check-timeout", type=float, default=30.0)
    g.add_argument("--rollout-health-check-first-wait", type=float, default=0.0)


def _add_data(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data / batch sizes")
    g.add_argument("--prompt-data", default=None, help="JSONL or parquet; 'path@[start:end]' selects a slice")
    g.add_argument("--input-key", default="input")
    g.add_argument("--label-key", default=None)
    g.add_argument("--metadata-key", default="metadata")
    g.add_argument("--tool-key", default="tools")
    g.add_argument("--multimodal-keys", type=_json_or_none, default=None)
    g.add_argument("--apply-chat-template", action="store_true")
    g.add_argument("--apply-chat-template-kwargs", default=None, help="JSON dict passed to apply_chat_template")
    g.add_argument("--disable-rollout-global-dataset", action="store_true")
    g.add_argument("--data-source-path", default="slime.rollout.data_source.RolloutDataSourceWithBuffer")
    g.add_argument("--num-rollout", type=int, default=None)
    g.add_argument("--num-epoch", type=int, default=None)
    g.add_argument("--start-rollout-id", type=int, default=None)
    g.add_argument("--rollout-batch-size", type=int, default=None, help="prompts per rollout (required)")
    g.add_argument("--n-samples-per-prompt", type=int, default=1)
    g.add_argument("--global-batch-size", type=int, default=None, help="groups (trajectories) per optimizer step")
    g.add_argument("--num-steps-per-rollout", type=int, default=None)
    g.add_argument("--micro-batch-size", type=int, default=1)
    g.add_argument("--use-dynamic-batch-size", action="store_true")
    g.add_argument("--max-tokens-per-gpu", type=int, default=None)
    g.add_argument("--log-probs-max-tokens-per-gpu", type=int, default=None)
    g.add_argument(
        "--share-prompt-prefix",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="pack samples of one micro-batch with an identical prompt as prompt + branches (exact; the prompt's "
        "tokens go through the model once instead of once per sample)",
    )
    g.add_argument("--balance-data", action="store_true")
    g.add_argument("--data-pad-size-multiplier", type=int, default=128)
    g.add_argument(
        "--allow-partial-last-step",
        action="store_true",
        help="train groups that do not fill the last step as a smaller step instead of carrying them over",
    )
    g.add_argument("--fan-out-reward", choices=["full", "split"], default="full")


def _add_algorithm(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("algorithm")
    g.add_argument(
        "--advantage-estimator",
        choices=["grpo", "gspo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo"],
        default="grpo",
    )
    g.add_argument("--loss-type", choices=["policy_loss", "sft_loss", "custom_loss"], default="policy_loss")
    g.add_argument("--custom-loss-function-path", default=None)
    g.add_argument("--disable-compute-advantages-and-returns", action="store_true")
    g.add_argument("--custom-advantage-function-path", default=None)
    g.add_argument("--eps-clip", type=float, default=0.2)
    g.add_argument("--eps-clip-high", type=float, default=None)
    g.add_argument("--eps-clip-c", type=float, default=None)
    g.add_argument("--value-clip", type=float, default=0.2)
    g.add_argument("--kl-coef", type=float, default=0.0)
    g.add_argument("--use-kl-loss", action="store_true")
    g.add_argument("--kl-loss-coef", type=float, default=0.0)
    g.add_argument("--kl-loss-type", choices=["k1", "k2", "k3", "low_var_kl"], default="k1")
    g.add_argument("--use-unbiased-kl", action="store_true")
    g.add_argument("--ref-load", default=None)
    g.add_argument("--ref-ckpt-step", type=int, default=None)
    g.add_argument("--ref-update-interval", type=int, default=None)
    g.add_argument("--entropy-coef", type=float, default=0.0)
    g.add_argument("--gamma", type=float, default=1.0)
    g.add_argument("--lambd", type=float, default=1.0)
    g.add_argument("--normalize-advantages", action="store_true")
    g.add_argument("--disable-grpo-std-normalization", action="store_true")
    g.add_argument("--disable-rewards-normalization", action="store_true")
    g.add_argument("--calculate-per-token-loss", action="store_true")
    g.add_argument("--use-rollout-logprobs", action="store_true")
    g.add_argument("--use-tis", action="store_true")
    g.add_argument("--tis-clip", type=float, default=2.0)
    g.add_argument("--tis-clip-low", type=float, default=0.0)
    g.add_argument("--custom-tis-function-path", default=None)
    g.add_argument("--custom-pg-loss-reducer-function-path", default=None)
    g.add_argument("--use-opsm", action="store_true")
    g.add_argument("--opsm-delta", type=float, default=1e-4)
    g.add_argument("--get-mismatch-metrics", action="store_true")
    g.add_argument("--log-probs-chunk-size", type=int, default=-1)
    g.add_argument("--num-critic-only-steps", type=int, default=0)
    g.add_argument("--megatron-config", "--megatron-config-path", dest="megatron_config", default=None)


def _add_reward_and_eval(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("reward")
    g.add_argument("--rm-type", default=None)
    g.add_argument("--rm-url", default=None)
    g.add_argument("--custom-rm-path", default=None)
    g.add_argument("--group-rm", action="store_true")
    g.add_argument("--reward-key", default=None)
    g.add_argument("--eval-reward-key", default=None)
    g.add_argument("--custom-reward-post-process-path", default=None)
    g.add_argument("--custom-convert-samples-to-train-data-path", default=None)
    g = p.add_argument_group("eval")
    g.add_argument("--eval-interval", type=int, default=None)
    g.add_argument("--eval-prompt-data", nargs="+", default=None, help="name path [name path ...]")
    g.add_argument("--skip-eval-before-train", action="store_true")
    g.add_argument("--n-samples-per-eval-prompt", type=int, default=1)
    g.add_argument("--eval-temperature", type=float, default=None)
    g.add_argument(
        "--eval-fixed-sampling-seed",
        action="store_true",
        help="every eval draws the sampling seeds of the first one, so eval curves differ only by the weights",
    )
    g.add_argument("--eval-top-p", type=float, default=None)
    g.add_argument("--eval-top-k", type=int, default=None)
    g.add_argument("--eval-max-response-len", type=int, default=None)
    g.add_argument("--eval-input-key", default=None)
    g.add_argument("--eval-label-key", default=None)
    g.add_argument("--eval-tool-key", default=None)


def _add_debug(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("debug / observability")
    g.add_argument("--debug-rollout-only", action="store_true", help="inference only: no training process groups")
    g.add_argument("--debug-train-only", action="store_true", help="training only: no engine, no router")
    g.add_argument("--save-debug-rollout-data", default=None, help="path template with {rollout_id}")
    g.add_argument("--load-debug-rollout-data", default=None, help="path template; implies --debug-train-only")
    g.add_argument("--load-debug-rollout-data-subsample", type=float, default=None)
    g.add_argument("--dump-details", default=None)
    g.add_argument("--metrics-dir", default="runs/latest", help="metrics.jsonl and TensorBoard events go here")
    g.add_argument("--use-tensorboard", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--custom-config-path", default=None, help="YAML of flat key: value pairs set onto args")
    g.add_argument("--custom-rollout-log-function-path", default=None)
    g.add_argument("--custom-eval-rollout-log-function-path", default=None)


def _add_megatron_style(p: argparse.ArgumentParser) -> None:
    """Megatron's flag names with slime's defaults; the megatron-core wheel has no argparse of its own."""
    g = p.add_argument_group("training (Megatron-style)")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=None)
    g.add_argument("--microbatch-group-size-per-vp-stage", type=int, default=None)
    g.add_argument("--context-parallel-size", type=int, default=1)
    g.add_argument("--expert-model-parallel-size", type=int, default=1)
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--lr", type=float, default=1e-6)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument(
        "--lr-decay-style", choices=["constant", "linear", "cosine", "inverse-square-root"], default="constant"
    )
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-decay-iters", type=int, default=None)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--bf16", action="store_true")
    g.add_argument(
        "--use-distributed-optimizer",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="shard optimizer state over DP (default: on with CUDA; on CPU it needs the shim's opt-in)",
    )
    g.add_argument("--load", default=None, help="checkpoint dir to resume from (no tracker file there: start fresh)")
    g.add_argument("--save", default=None, help="checkpoint dir: iter_XXXXXXX/ per save, tracker file written last")
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--no-save-optim", action="store_true")
    g.add_argument("--no-load-optim", action="store_true", help="resume model weights only (fresh optimizer)")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument(
        "--dist-ckpt-optim-fully-reshardable",
        action="store_true",
        help="distributed optimizer: save a canonical per-parameter state (reshardable in TP/PP too; gathers on DP 0)",
    )
    g.add_argument("--save-hf", default=None, help="HF export dir per save; may contain {rollout_id}")
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None)
    g.add_argument("--distributed-backend", choices=["nccl", "gloo"], default=None)
    g.add_argument("--distributed-timeout-minutes", type=int, default=10)
    g.add_argument("--update-weight-buffer-size", type=int, default=512 * 1024**2, help="bytes per weight bucket")
    g.add_argument("--update-weights-interval", type=int, default=1)
    g.add_argument(
        "--update-weight-mode",
        choices=["auto", "tensor", "distributed"],
        default="auto",
        help="weight sync transport: tensor (colocated, CUDA IPC / shared memory) or distributed (a process group "
        "with the engines, NCCL on GPU, gloo on CPU); auto = tensor with --colocate, else distributed",
    )
    g.add_argument(
        "--check-weight-update-equal",
        action="store_true",
        help="after every sync, compare each engine's weight checksum with the trainer's (slow; for debugging)",
    )
    g.add_argument("--custom-megatron-init-path", default=None)
    g.add_argument("--custom-megatron-before-log-prob-hook-path", default=None)
    g.add_argument("--custom-megatron-before-train-step-hook-path", default=None)


def build_parser(add_custom_arguments: Callable[[argparse.ArgumentParser], None] | None = None) -> _Parser:
    """The full parser; `add_custom_arguments` runs first so user flags may pre-empt slime names (as in slime)."""
    from slime.agent.arguments import add_agent_arguments
    from slime.backends.sglang.flags import add_router_arguments, add_sglang_arguments

    p = _Parser(prog="slime train", allow_abbrev=False, description="RL post-training with Megatron-core + SGLang")
    if add_custom_arguments is not None:
        add_custom_arguments(p)
    for add in (_add_cluster, _add_rollout, _add_data, _add_algorithm, _add_reward_and_eval, _add_debug):
        add(p)
    _add_megatron_style(p)
    add_agent_arguments(p)
    add_sglang_arguments(p)
    add_router_arguments(p)
    return p


def _reject_unknown(parser: argparse.ArgumentParser, unknown: list[str]) -> None:
    from slime.backends.sglang.flags import check_unknown_prefixed

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
        if not hasattr(args, dest):
            close = difflib.get_close_matches(dest, vars(args), n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise SlimeArgError(f"--custom-config-path {path}: unknown key {key!r}{hint}")
        logger.info("custom config %s: %s = %r (was %r)", path, dest, value, getattr(args, dest))
        setattr(args, dest, value)


def parse_args(
    argv: Sequence[str] | None = None,
    add_custom_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
) -> argparse.Namespace:
    parser = build_parser(add_custom_arguments)
    args, unknown = parser.parse_known_args(argv)
    _reject_unknown(parser, unknown)
    if args.custom_config_path:
        apply_custom_config(args, args.custom_config_path)
    validate_args(args)
    return args


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise SlimeArgError(message)


def validate_args(args: argparse.Namespace) -> None:
    """slime's cross-flag rules; derived values are written back onto args (as slime does)."""
    if args.dump_details:
        args.save_debug_rollout_data = args.save_debug_rollout_data or os.path.join(
            args.dump_details, "rollout_data", "{rollout_id}.pt"
        )
    if args.load_debug_rollout_data:
        args.debug_train_only = True
    _require(
        not (args.debug_rollout_only and args.debug_train_only),
        "--debug-rollout-only and --debug-train-only (or --load-debug-rollout-data) exclude each other; pick one",
    )
    _require(
        args.rollout_batch_size is not None,
        "--rollout-batch-size is required (prompts per rollout), e.g. --rollout-batch-size 8",
    )
    _require(args.rollout_batch_size > 0, "--rollout-batch-size must be > 0")
    _require(args.n_samples_per_prompt > 0, "--n-samples-per-prompt must be > 0")
    _require(
        args.num_rollout is not None or args.num_epoch is not None,
        "one of --num-rollout or --num-epoch is required, e.g. --num-rollout 3",
    )
    if args.over_sampling_batch_size is None:
        args.over_sampling_batch_size = args.rollout_batch_size
    _require(
        args.over_sampling_batch_size >= args.rollout_batch_size,
        f"--over-sampling-batch-size ({args.over_sampling_batch_size}) must be >= --rollout-batch-size "
        f"({args.rollout_batch_size})",
    )
    groups_per_rollout = args.rollout_batch_size * args.n_samples_per_prompt
    if args.num_steps_per_rollout is not None:
        _require(args.num_steps_per_rollout > 0, "--num-steps-per-rollout must be > 0")
        gbs = groups_per_rollout // args.num_steps_per_rollout
        _require(
            args.global_batch_size in (None, gbs),
            f"--global-batch-size {args.global_batch_size} contradicts "
            f"--num-steps-per-rollout {args.num_steps_per_rollout} (which gives {gbs}); drop one of them",
        )
        args.global_batch_size = gbs
    if args.global_batch_size is None:
        args.global_batch_size = groups_per_rollout  # one optimizer step per rollout
    _require(args.global_batch_size > 0, "--global-batch-size must be > 0")
    if args.use_dynamic_batch_size:
        _require(args.max_tokens_per_gpu is not None, "--use-dynamic-batch-size needs --max-tokens-per-gpu N")
    if args.log_probs_max_tokens_per_gpu is None:
        args.log_probs_max_tokens_per_gpu = args.max_tokens_per_gpu
    if args.eps_clip_high is None:
        args.eps_clip_high = args.eps_clip
    if args.eps_clip_c is not None:
        _require(args.eps_clip_c > 1.0, f"--eps-clip-c must be > 1 (dual-clip bound), got {args.eps_clip_c}")
    _require(not (args.kl_coef and args.kl_loss_coef), "only one of --kl-coef and --kl-loss-coef may be non-zero")
    _require(
        not (args.use_rollout_logprobs and args.use_tis), "--use-rollout-logprobs and --use-tis exclude each other"
    )
    if args.n_samples_per_prompt == 1:
        args.disable_grpo_std_normalization = True
    args.use_critic = args.advantage_estimator == "ppo"
    if args.eval_prompt_data is not None:
        _require(len(args.eval_prompt_data) % 2 == 0, "--eval-prompt-data takes pairs: name path [name path ...]")

    actor_gpus = args.actor_num_nodes * args.actor_num_gpus_per_node
    if args.offload:
        args.offload_train = args.offload_rollout = True
    if args.debug_rollout_only:
        # Inference alone: no colocation, no offload, actors rewritten to the rollout size (spec §3).
        args.colocate = False
        args.offload_train = args.offload_rollout = False
        if args.rollout_num_gpus is None:
            args.rollout_num_gpus = actor_gpus
        args.actor_num_gpus_per_node = min(8, args.rollout_num_gpus)
        args.actor_num_nodes = max(1, args.rollout_num_gpus // max(1, args.actor_num_gpus_per_node))
    elif args.colocate:
        args.offload_train = True if args.offload_train is None else args.offload_train
        args.offload_rollout = True if args.offload_rollout is None else args.offload_rollout
        if args.rollout_num_gpus is None:
            args.rollout_num_gpus = actor_gpus
    args.offload_train = bool(args.offload_train)
    args.offload_rollout = bool(args.offload_rollout)
    if args.update_weight_mode == "auto":
        # colocated engines share the trainer's GPUs: hand over IPC handles; otherwise broadcast to their GPUs
        args.update_weight_mode = "tensor" if args.colocate else "distributed"
    _require(
        not (args.colocate and args.update_weight_mode == "distributed"),
        "--update-weight-mode distributed needs engines on their own GPUs; with --colocate use tensor (the default)",
    )
    if args.save_interval is not None:
        _require(args.save_interval > 0, "--save-interval must be > 0")
    if not args.debug_train_only and not args.rollout_external:
        _require(
            args.rollout_num_gpus is not None,
            "--rollout-num-gpus is required unless --colocate, e.g. --rollout-num-gpus 2",
        )
        _require(
            args.rollout_num_gpus % args.rollout_num_gpus_per_engine == 0,
            f"--rollout-num-gpus ({args.rollout_num_gpus}) must be a multiple of --rollout-num-gpus-per-engine "
            f"({args.rollout_num_gpus_per_engine})",
        )
    if args.rollout_num_gpus is None:
        args.rollout_num_gpus = 0
    if not args.debug_train_only and args.hf_checkpoint is None:
        raise SlimeArgError("--hf-checkpoint is required (tokenizer and initial weights of the rollout engines)")
    if args.hf_checkpoint is not None and not os.path.isfile(os.path.join(args.hf_checkpoint, "config.json")):
        raise SlimeArgError(f"--hf-checkpoint {args.hf_checkpoint}: no config.json there (expected an HF model dir)")
    for name in ("sim_script", "sim_synthetic_config"):
        path = getattr(args, name)
        if path is not None and not os.path.isfile(path):
            raise SlimeArgError(f"--{name.replace('_', '-')}: file not found: {path}")
    if args.rollout_engine == "sim" and args.sim_engine == "scripted":
        _require(args.sim_script is not None, "--sim-engine scripted needs --sim-script FILE (rules)")
    from slime.agent.arguments import resolve_agent_args

    resolve_agent_args(args)
    args.eval_function_path = args.eval_function_path or args.rollout_function_path
    args.world_size = actor_gpus
    args.sglang_model_routers = {}
