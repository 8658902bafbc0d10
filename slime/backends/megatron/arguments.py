"""Megatron-style training flags, with Megatron's names and slime's defaults (the megatron-core wheel has no
argparse of its own), plus weight-sync and megatron hook flags."""

from __future__ import annotations

import argparse
import json
import os

from slime.backends.megatron.hf_config import MOE_MODEL_TYPES, HFModelSpec, read_hf_config
from slime.utils.errors import SlimeArgError

# Flags whose features are not built yet; setting one is refused before Ray starts (slime/arguments.py).
UNSUPPORTED: dict[str, str] = {}


def add_megatron_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training (Megatron-style)")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument(
        "--virtual-pipeline-model-parallel-size",
        type=int,
        default=None,
        help="model chunks per pipeline rank (megatron's interleaved schedule); needs --pipeline-model-parallel-size > 1",
    )
    g.add_argument(
        "--num-layers-per-virtual-pipeline-stage",
        type=int,
        default=None,
        help="Megatron-LM's other way to ask for virtual stages: decoder layers per model chunk; sets "
        "--virtual-pipeline-model-parallel-size to the checkpoint's layers / (pipeline size x this)",
    )
    g.add_argument(
        "--microbatch-group-size-per-vp-stage",
        type=int,
        default=None,
        help="micro-batches a virtual stage runs back to back (default and minimum: the pipeline size)",
    )
    g.add_argument(
        "--context-parallel-size",
        type=int,
        default=1,
        help="split every packed micro-batch over this many ranks (zigzag chunks; attention exact across them)",
    )
    g.add_argument(
        "--expert-model-parallel-size",
        type=int,
        default=1,
        help="MoE: split the experts of every layer over this many ranks (must divide num_experts)",
    )
    g.add_argument(
        "--expert-tensor-parallel-size",
        type=int,
        default=None,
        help="MoE: tensor-parallel size of each expert (default: --tensor-model-parallel-size); only 1 for now",
    )
    g.add_argument(
        "--moe-aux-loss-coeff",
        type=float,
        default=None,
        help="MoE: weight of megatron's router load-balancing (aux) loss in the train loss (default: the "
        "checkpoint's router_aux_loss_coef; 0 turns the term off, train/moe_load_balancing_loss is logged anyway)",
    )
    g.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="split the sequence over the TP group outside attention and the MLP (norms, residuals, dropout); "
        "needs --tensor-model-parallel-size > 1; required for MoE with TP > 1",
    )
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
    g.add_argument(
        "--critic-load",
        default=None,
        help="PPO: checkpoint dir the critic resumes from (default: critic/ under --load)",
    )
    g.add_argument(
        "--critic-save", default=None, help="PPO: checkpoint dir of the critic (default: critic/ under --save)"
    )
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
    g.add_argument("--custom-megatron-init-path", default=None, help="fn(args), before any model is built")
    g.add_argument(
        "--custom-megatron-before-log-prob-hook-path",
        default=None,
        help="fn(args, model, store_prefix) before each log-prob pass ('' for π_old, 'ref_' for π_ref)",
    )
    g.add_argument(
        "--custom-megatron-before-train-step-hook-path",
        default=None,
        help="fn(args, rollout_id, step_id, model, optimizer, opt_param_scheduler) before each optimizer step",
    )


def validate_megatron_args(args: argparse.Namespace) -> None:
    if args.tensor_model_parallel_size < 1:
        raise SlimeArgError("--tensor-model-parallel-size must be >= 1")
    if args.world_size % args.tensor_model_parallel_size and not args.debug_rollout_only:
        raise SlimeArgError(
            f"--tensor-model-parallel-size {args.tensor_model_parallel_size} does not divide the "
            f"{args.world_size} train GPUs (--actor-num-nodes x --actor-num-gpus-per-node)"
        )
    cp, pp = args.context_parallel_size, args.pipeline_model_parallel_size
    if cp < 1 or pp < 1:
        raise SlimeArgError("--context-parallel-size and --pipeline-model-parallel-size must be >= 1")
    if args.world_size % (args.tensor_model_parallel_size * cp * pp) and not args.debug_rollout_only:
        raise SlimeArgError(
            f"--tensor-model-parallel-size {args.tensor_model_parallel_size} x --context-parallel-size {cp} x "
            f"--pipeline-model-parallel-size {pp} does not divide the {args.world_size} train GPUs "
            "(--actor-num-nodes x --actor-num-gpus-per-node)"
        )
    if args.num_layers_per_virtual_pipeline_stage is not None:
        args.virtual_pipeline_model_parallel_size = _vpp_from_layers_per_stage(args, pp)
    vpp, group = args.virtual_pipeline_model_parallel_size, args.microbatch_group_size_per_vp_stage
    if vpp is not None and (vpp < 1 or (vpp > 1 and pp == 1)):
        raise SlimeArgError("--virtual-pipeline-model-parallel-size needs --pipeline-model-parallel-size > 1")
    if group is not None and (not vpp or vpp == 1 or group < pp):
        raise SlimeArgError(
            "--microbatch-group-size-per-vp-stage needs --virtual-pipeline-model-parallel-size > 1 and must be >= "
            "--pipeline-model-parallel-size"
        )
    if vpp and vpp > 1 and args.offload_train:
        raise SlimeArgError(
            "--virtual-pipeline-model-parallel-size > 1 with --offload-train (the --colocate default): offload keeps "
            "one model chunk per rank for now; pass --no-offload-train or drop the virtual stages"
        )
    if pp > 1 and args.advantage_estimator == "ppo":
        raise SlimeArgError(
            "--pipeline-model-parallel-size > 1 with --advantage-estimator ppo: the critic is not pipelined yet"
        )
    if cp > 1 and args.advantage_estimator == "ppo":
        raise SlimeArgError(
            "--context-parallel-size > 1 with --advantage-estimator ppo: the critic is not context-parallel yet"
        )
    if args.sequence_parallel and args.tensor_model_parallel_size == 1:
        raise SlimeArgError(
            "--sequence-parallel needs --tensor-model-parallel-size > 1 (it splits the sequence over the TP group)"
        )
    if args.sequence_parallel and (cp > 1 or (vpp or 1) > 1):
        raise SlimeArgError(
            "--sequence-parallel with --context-parallel-size > 1 or virtual pipeline stages is not proven yet "
            "(tests/unit/test_megatron_layouts.py covers TP x SP and TP x PP x SP)"
        )
    if args.sequence_parallel and args.advantage_estimator == "ppo":
        raise SlimeArgError(
            "--sequence-parallel with --advantage-estimator ppo: the critic's value head is not sequence-parallel yet"
        )
    validate_moe_args(args)
    if args.update_weights_interval < 1:
        raise SlimeArgError("--update-weights-interval must be >= 1")
    if args.update_weight_mode == "auto":
        # colocated engines share the trainer's GPUs: hand over IPC handles; otherwise broadcast to their GPUs
        args.update_weight_mode = "tensor" if args.colocate else "distributed"
    if args.colocate and args.update_weight_mode == "distributed":
        raise SlimeArgError(
            "--update-weight-mode distributed needs engines on their own GPUs; with --colocate use tensor (the default)"
        )
    if args.save_interval is not None and args.save_interval <= 0:
        raise SlimeArgError("--save-interval must be > 0")


def _vpp_from_layers_per_stage(args: argparse.Namespace, pp: int) -> int:
    """--num-layers-per-virtual-pipeline-stage as the number of model chunks per pipeline rank."""
    per = args.num_layers_per_virtual_pipeline_stage
    if args.virtual_pipeline_model_parallel_size is not None:
        raise SlimeArgError(
            "--num-layers-per-virtual-pipeline-stage and --virtual-pipeline-model-parallel-size both ask for "
            "virtual stages: pass one"
        )
    if per < 1 or pp == 1:
        raise SlimeArgError(
            "--num-layers-per-virtual-pipeline-stage needs a value >= 1 and --pipeline-model-parallel-size > 1"
        )
    path = os.path.join(args.hf_checkpoint or "", "config.json")
    try:
        with open(path) as f:
            layers = int(json.load(f)["num_hidden_layers"])
    except (OSError, ValueError, KeyError, TypeError):
        raise SlimeArgError(
            f"--num-layers-per-virtual-pipeline-stage needs the layer count of --hf-checkpoint ({path} unreadable)"
        ) from None
    if layers % (pp * per):
        raise SlimeArgError(
            f"--num-layers-per-virtual-pipeline-stage {per} x --pipeline-model-parallel-size {pp} does not divide "
            f"the checkpoint's {layers} layers"
        )
    return layers // (pp * per)


def _moe_spec(args: argparse.Namespace) -> HFModelSpec | None:
    """The checkpoint's shape when it is an MoE model; None for a dense or unreadable one (checked elsewhere)."""
    path = os.path.join(args.hf_checkpoint or "", "config.json")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(cfg, dict) or cfg.get("model_type") not in MOE_MODEL_TYPES:
        return None
    try:
        return read_hf_config(cfg)
    except KeyError as e:
        raise SlimeArgError(f"--hf-checkpoint {args.hf_checkpoint}: config.json has no {e.args[0]!r}") from None


def validate_moe_args(args: argparse.Namespace) -> None:
    """Expert parallelism only for MoE checkpoints, and MoE only in the layouts proven equal to one process
    (tests/unit/test_moe_layouts.py: EP, DP, CP, PP, EP with CP or PP, and EP x TP with sequence parallelism and
    whole experts); each refusal is one line before Ray starts."""
    ep, etp = args.expert_model_parallel_size, args.expert_tensor_parallel_size
    if ep < 1 or (etp is not None and etp < 1):
        raise SlimeArgError("--expert-model-parallel-size and --expert-tensor-parallel-size must be >= 1")
    if args.debug_rollout_only:
        return
    spec = _moe_spec(args)
    if spec is None:
        if ep > 1 or etp is not None:
            flag = "--expert-model-parallel-size" if ep > 1 else "--expert-tensor-parallel-size"
            raise SlimeArgError(
                f"{flag} needs an MoE checkpoint ({', '.join(MOE_MODEL_TYPES)}); --hf-checkpoint is dense"
            )
        return
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if tp > 1 and not args.sequence_parallel:
        raise SlimeArgError(
            "--tensor-model-parallel-size > 1 with an MoE model: megatron-core trains MoE layers under TP only with "
            "sequence parallelism; add --sequence-parallel"
        )
    if (etp or tp) > 1:  # megatron's default expert TP size is the TP size
        raise SlimeArgError(
            "--expert-tensor-parallel-size > 1 is not supported yet (experts are whole on each rank); with "
            "--tensor-model-parallel-size > 1 pass --expert-tensor-parallel-size 1"
        )
    if (args.virtual_pipeline_model_parallel_size or 1) > 1:
        raise SlimeArgError("--virtual-pipeline-model-parallel-size with an MoE model is not supported yet")
    if args.advantage_estimator == "ppo":
        raise SlimeArgError("--advantage-estimator ppo with an MoE model: the critic is not built for MoE yet")
    if spec.num_experts % ep:
        raise SlimeArgError(f"--expert-model-parallel-size {ep} must divide num_experts ({spec.num_experts})")
    if args.world_size % (ep * pp):
        raise SlimeArgError(
            f"--expert-model-parallel-size {ep} x --pipeline-model-parallel-size {pp} does not divide the "
            f"{args.world_size} train GPUs (--actor-num-nodes x --actor-num-gpus-per-node)"
        )
