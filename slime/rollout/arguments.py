"""Rollout-side flags: the rollout and generate hooks, sampling, prompt data, filters, rewards and eval."""

from __future__ import annotations

import argparse
import os

from slime.utils.errors import SlimeArgError

DEFAULT_ROLLOUT_FN = "slime.rollout.sglang_rollout.generate_rollout"
DEFAULT_DATA_SOURCE = "slime.rollout.data_source.RolloutDataSourceWithBuffer"
# Flags whose features are not built yet; setting one is refused before Ray starts (slime/arguments.py).
UNSUPPORTED = {"multimodal_keys": "slime here trains on text prompts only"}


def add_rollout_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("rollout")
    g.add_argument("--hf-checkpoint", default=None, help="tokenizer and initial weights (an HF model directory)")
    g.add_argument("--model-name", default=None, help="name of the trained model in --sglang-config's routers")
    g.add_argument("--rollout-function-path", default=DEFAULT_ROLLOUT_FN)
    g.add_argument("--custom-generate-function-path", default=None)
    g.add_argument("--eval-function-path", default=None, help="defaults to --rollout-function-path")
    g.add_argument("--rollout-temperature", type=float, default=1.0)
    g.add_argument("--rollout-top-p", type=float, default=1.0)
    g.add_argument("--rollout-top-k", type=int, default=-1)
    g.add_argument("--rollout-max-response-len", type=int, default=1024, help="max_new_tokens of one trajectory")
    g.add_argument("--rollout-max-context-len", type=int, default=None, help="prompt + response cap")
    g.add_argument("--rollout-max-prompt-len", type=int, default=None, help="longer prompts are dropped at load")
    g.add_argument("--rollout-stop", nargs="+", default=None)
    g.add_argument("--rollout-stop-token-ids", type=int, nargs="+", default=None)
    g.add_argument("--rollout-skip-special-tokens", action="store_true")
    g.add_argument("--rollout-shuffle", action="store_true", help="reshuffle the prompts every epoch")
    g.add_argument("--rollout-seed", type=int, default=42)
    g.add_argument("--over-sampling-batch-size", type=int, default=None, help="groups pulled per refill")
    g.add_argument("--dynamic-sampling-filter-path", default=None)
    g.add_argument("--partial-rollout", action="store_true", help="unfinished groups return to the buffer")
    g.add_argument("--mask-offpolicy-in-partial-rollout", action="store_true")
    g.add_argument("--buffer-filter-path", default=None)
    g.add_argument("--rollout-sample-filter-path", default=None)
    g.add_argument("--rollout-all-samples-process-path", default=None)
    g.add_argument(
        "--rollout-data-postprocess-path",
        default=None,
        help="fn(args, rollout_id, rollout_data) on each train rank after log-probs and advantages",
    )

    g = p.add_argument_group("prompt data")
    g.add_argument("--prompt-data", default=None, help="JSONL or parquet; 'path@[start:end]' selects a slice")
    g.add_argument("--input-key", default="input")
    g.add_argument("--label-key", default=None)
    g.add_argument("--metadata-key", default="metadata")
    g.add_argument("--tool-key", default="tools")
    g.add_argument("--multimodal-keys", default=None, help="not supported yet (text prompts only)")
    g.add_argument("--apply-chat-template", action="store_true")
    g.add_argument("--apply-chat-template-kwargs", default=None, help="JSON dict passed to apply_chat_template")
    g.add_argument("--disable-rollout-global-dataset", action="store_true")
    g.add_argument("--data-source-path", default=DEFAULT_DATA_SOURCE)
    g.add_argument("--num-rollout", type=int, default=None)
    g.add_argument("--num-epoch", type=int, default=None)
    g.add_argument("--start-rollout-id", type=int, default=None)
    g.add_argument("--rollout-batch-size", type=int, default=None, help="prompts per rollout (required)")
    g.add_argument("--n-samples-per-prompt", type=int, default=1)

    g = p.add_argument_group("reward")
    g.add_argument("--rm-type", default=None)
    g.add_argument("--rm-url", default=None)
    g.add_argument("--custom-rm-path", default=None)
    g.add_argument(
        "--rm-model-name",
        default="reward",
        help="--rm-type reward_model / reward_model_chat: the --sglang-config model that judges the responses",
    )
    g.add_argument(
        "--rm-judge-template",
        default=None,
        help="text file of the judge prompt with {prompt}, {response}, {label}; its answer must hold 'score: <x>'",
    )
    g.add_argument("--rm-judge-max-tokens", type=int, default=32, help="longest judge answer read for a score")
    g.add_argument("--group-rm", action="store_true")
    g.add_argument("--reward-key", default=None)
    g.add_argument("--eval-reward-key", default=None)
    g.add_argument("--custom-reward-post-process-path", default=None)
    g.add_argument(
        "--custom-convert-samples-to-train-data-path",
        default=None,
        help="fn(args, samples) -> dict of per-sample lists; replaces the default samples -> train data step",
    )

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
    g.add_argument("--eval-min-new-tokens", type=int, default=None)
    g.add_argument("--eval-max-prompt-len", type=int, default=None, help="defaults to --rollout-max-prompt-len")
    g.add_argument("--eval-input-key", default=None)
    g.add_argument("--eval-label-key", default=None)
    g.add_argument("--eval-tool-key", default=None)


def validate_rollout_args(args: argparse.Namespace) -> None:
    if args.rollout_batch_size is None:
        raise SlimeArgError("--rollout-batch-size is required (prompts per rollout), e.g. --rollout-batch-size 8")
    if args.rollout_batch_size <= 0:
        raise SlimeArgError("--rollout-batch-size must be > 0")
    if args.n_samples_per_prompt <= 0:
        raise SlimeArgError("--n-samples-per-prompt must be > 0")
    if args.num_rollout is None and args.num_epoch is None:
        raise SlimeArgError("one of --num-rollout or --num-epoch is required, e.g. --num-rollout 3")
    if args.over_sampling_batch_size is None:
        args.over_sampling_batch_size = args.rollout_batch_size
    if args.over_sampling_batch_size < args.rollout_batch_size:
        raise SlimeArgError(
            f"--over-sampling-batch-size ({args.over_sampling_batch_size}) must be >= --rollout-batch-size "
            f"({args.rollout_batch_size})"
        )
    if args.eval_prompt_data is not None and len(args.eval_prompt_data) % 2:
        raise SlimeArgError("--eval-prompt-data takes pairs: name path [name path ...]")
    args.eval_function_path = args.eval_function_path or args.rollout_function_path
    if args.rm_judge_template is not None and not os.path.isfile(args.rm_judge_template):
        raise SlimeArgError(f"--rm-judge-template: file not found: {args.rm_judge_template}")
    if args.rm_judge_max_tokens < 1:
        raise SlimeArgError("--rm-judge-max-tokens must be >= 1")
