"""Algorithm flags: advantage estimator, loss, clipping, KL, off-policy corrections, custom loss hooks."""

from __future__ import annotations

import argparse
import os

from slime.utils.errors import SlimeArgError

# Flags whose features are not built yet; setting one is refused before Ray starts (slime/arguments.py).
UNSUPPORTED = {
    "ref_ckpt_step": "--ref-load takes an HF checkpoint directory (no iterations to pick from)",
    "opd_teacher_ckpt_step": "--opd-teacher-load takes an HF checkpoint directory (no iterations to pick from)",
}


def add_algorithm_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("algorithm")
    g.add_argument(
        "--advantage-estimator",
        choices=["grpo", "gspo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo"],
        default="grpo",
    )
    g.add_argument("--loss-type", choices=["policy_loss", "sft_loss", "custom_loss"], default="policy_loss")
    g.add_argument(
        "--custom-loss-function-path",
        default=None,
        help="fn(args, batch, logits, reducer) -> (loss, metrics) for --loss-type custom_loss",
    )
    g.add_argument(
        "--disable-compute-advantages-and-returns",
        action="store_true",
        help="skip the built-in advantages; --rollout-data-postprocess-path (or the loss) provides them",
    )
    g.add_argument("--custom-advantage-function-path", default=None)
    g.add_argument("--eps-clip", type=float, default=0.2)
    g.add_argument("--eps-clip-high", type=float, default=None)
    g.add_argument("--eps-clip-c", type=float, default=None)
    g.add_argument(
        "--value-clip",
        type=float,
        default=0.2,
        help="PPO: the critic's values move at most this far from the old values in the clipped value loss",
    )
    g.add_argument("--kl-coef", type=float, default=0.0)
    g.add_argument("--use-kl-loss", action="store_true")
    g.add_argument("--kl-loss-coef", type=float, default=0.0)
    g.add_argument("--kl-loss-type", choices=["k1", "k2", "k3", "low_var_kl"], default="k1")
    g.add_argument("--use-unbiased-kl", action="store_true")
    g.add_argument("--ref-load", default=None, help="HF checkpoint of the reference policy (default: the initial one)")
    g.add_argument("--ref-ckpt-step", type=int, default=None, help="not supported yet")
    g.add_argument(
        "--ref-update-interval",
        type=int,
        default=None,
        help="copy the actor's weights into the reference policy after every N rollouts",
    )
    g.add_argument(
        "--ref-model-name",
        default=None,
        help="take the reference log-probs from this --sglang-config model (scored on the rollout side) instead "
        "of a reference copy of the weights on the trainer",
    )
    g.add_argument(
        "--use-opd",
        action="store_true",
        help="on-policy distillation: every response token's advantage -= --opd-kl-coef * (student - teacher) log-prob",
    )
    g.add_argument(
        "--opd-type",
        choices=["sglang", "megatron"],
        default=None,
        help="sglang: teacher log-probs from --opd-teacher-models of --sglang-config (rollout side); megatron: "
        "from the --opd-teacher-load checkpoint, forwarded on the trainer",
    )
    g.add_argument("--opd-kl-coef", type=float, default=1.0)
    g.add_argument("--opd-teacher-load", default=None, help="--opd-type megatron: the teacher's HF checkpoint")
    g.add_argument("--opd-teacher-ckpt-step", type=int, default=None, help="not supported yet")
    g.add_argument(
        "--opd-teacher-models",
        nargs="+",
        default=["teacher"],
        help="--opd-type sglang: the --sglang-config models that score each response; with several, the teacher "
        "log-prob of a token is their mean (docs/algorithms.md#on-policy-distillation)",
    )
    g.add_argument("--entropy-coef", type=float, default=0.0)
    g.add_argument("--gamma", type=float, default=1.0)
    g.add_argument("--lambd", type=float, default=1.0, help="GAE's λ (PPO)")
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
    g.add_argument(
        "--get-mismatch-metrics",
        action="store_true",
        help="log the trainer/engine log-prob mismatch (TIS ratios; π_old is recomputed for it); the loss changes "
        "only with --use-tis",
    )
    g.add_argument("--log-probs-chunk-size", type=int, default=-1)
    g.add_argument(
        "--num-critic-only-steps",
        type=int,
        default=0,
        help="PPO: for the first N rollouts only the critic trains (the actor's weights stay as they are)",
    )
    g.add_argument(
        "--megatron-config",
        "--megatron-config-path",
        dest="megatron_config",
        default=None,
        help="YAML of per-role training overrides: megatron: [{name, role: actor|critic, overrides: {lr: ..}}]",
    )


def validate_algorithm_args(args: argparse.Namespace) -> None:
    if args.advantage_estimator == "ppo":
        if not (0.0 <= args.gamma <= 1.0 and 0.0 <= args.lambd <= 1.0):
            raise SlimeArgError(f"--gamma and --lambd must lie in [0, 1], got {args.gamma} and {args.lambd}")
        if args.value_clip <= 0:
            raise SlimeArgError(f"--value-clip must be > 0, got {args.value_clip}")
    if args.num_critic_only_steps < 0:
        raise SlimeArgError("--num-critic-only-steps must be >= 0")
    if args.num_critic_only_steps and args.advantage_estimator != "ppo":
        raise SlimeArgError("--num-critic-only-steps needs --advantage-estimator ppo (there is no critic otherwise)")
    if args.loss_type == "custom_loss" and not args.custom_loss_function_path:
        raise SlimeArgError("--loss-type custom_loss needs --custom-loss-function-path module.fn")
    if args.eps_clip_high is None:
        args.eps_clip_high = args.eps_clip
    if args.eps_clip_c is not None and args.eps_clip_c <= 1.0:
        raise SlimeArgError(f"--eps-clip-c must be > 1 (dual-clip bound), got {args.eps_clip_c}")
    if args.kl_coef and args.kl_loss_coef:
        raise SlimeArgError("only one of --kl-coef and --kl-loss-coef may be non-zero")
    if args.use_rollout_logprobs and args.use_tis:
        raise SlimeArgError("--use-rollout-logprobs and --use-tis exclude each other")
    if args.ref_update_interval is not None:
        if args.ref_update_interval < 1:
            raise SlimeArgError("--ref-update-interval must be >= 1")
        if not (args.use_kl_loss or args.kl_coef):
            raise SlimeArgError("--ref-update-interval needs a reference policy (--use-kl-loss or --kl-coef)")
    if args.n_samples_per_prompt == 1:
        args.disable_grpo_std_normalization = True
    validate_opd_args(args)
    if args.ref_model_name is not None:
        if not (args.use_kl_loss or args.kl_coef):
            raise SlimeArgError("--ref-model-name needs a reference policy in the loss (--use-kl-loss or --kl-coef)")
        if args.ref_load or args.ref_update_interval:
            raise SlimeArgError(
                "--ref-model-name serves the reference from --sglang-config; --ref-load and --ref-update-interval "
                "configure the trainer-side copy instead"
            )


def validate_opd_args(args: argparse.Namespace) -> None:
    if not args.use_opd:
        if args.opd_type is not None or args.opd_teacher_load is not None:
            raise SlimeArgError("--opd-type / --opd-teacher-load are read only with --use-opd")
        return
    if args.opd_type is None:
        raise SlimeArgError("--use-opd needs --opd-type sglang (teacher models of --sglang-config) or megatron")
    if args.opd_type == "megatron" and not args.opd_teacher_load:
        raise SlimeArgError("--opd-type megatron needs --opd-teacher-load (the teacher's HF checkpoint)")
    if args.opd_teacher_load and not os.path.isfile(os.path.join(args.opd_teacher_load, "config.json")):
        raise SlimeArgError(f"--opd-teacher-load {args.opd_teacher_load}: no config.json there (expected an HF dir)")
    if args.opd_type == "sglang" and args.opd_teacher_load:
        raise SlimeArgError("--opd-type sglang scores with --opd-teacher-models; --opd-teacher-load is for megatron")
    if args.loss_type != "policy_loss":
        raise SlimeArgError("--use-opd changes the advantages of --loss-type policy_loss only")
