"""Cluster and placement flags: how many GPUs train and serve, colocation, offload, the Ray cluster."""

from __future__ import annotations

import argparse

from slime.backends.train_backend import TRAIN_BACKENDS
from slime.utils.errors import SlimeArgError
from slime.utils.misc import json_arg


def add_cluster_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cluster / placement")
    g.add_argument("--actor-num-nodes", type=int, default=1)
    g.add_argument("--actor-num-gpus-per-node", type=int, default=8)
    g.add_argument("--rollout-num-gpus", type=int, default=None, help="inference GPUs (the actor's under --colocate)")
    g.add_argument("--rollout-num-gpus-per-engine", type=int, default=1, help="GPUs per engine; may span nodes")
    g.add_argument("--num-gpus-per-node", type=int, default=8, help="node size for engine/node arithmetic")
    g.add_argument("--colocate", action="store_true", help="engines share the train GPUs (time-shared by offload)")
    g.add_argument("--offload", action="store_true", help="shorthand for --offload-train --offload-rollout")
    g.add_argument("--offload-train", action=argparse.BooleanOptionalAction, default=None)
    g.add_argument("--offload-rollout", action=argparse.BooleanOptionalAction, default=None)
    g.add_argument(
        "--legacy-offload",
        action="store_true",
        help="--offload-train keeps a host copy of everything (params, grads, optimizer) while asleep, plus one more "
        "copy of the params; the default keeps only the optimizer state and one pinned copy of the weights",
    )
    g.add_argument(
        "--train-env-vars",
        type=json_arg,
        default={},
        help='JSON object of environment variables for the train actors, e.g. \'{"NCCL_DEBUG": "INFO"}\'',
    )
    g.add_argument(
        "--train-backend",
        default="megatron",
        help="megatron, or the import path of a TrainBackend class (slime/backends/train_backend.py)",
    )
    g.add_argument(
        "--ray-address", default=None, help="join an existing Ray cluster (e.g. auto) instead of starting one"
    )
    add_fault_arguments(p)


def add_fault_arguments(p: argparse.ArgumentParser) -> None:
    """How a run meets a dead or hung actor (slime/ray/actor_faults.py, slime/ray/restarts.py)."""
    g = p.add_argument_group("actor faults")
    g.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="restart the whole job from its newest complete checkpoint after a dead or hung actor, at most N "
        "times (needs --save); 0: the run ends with one line naming the actor, the fault and the checkpoint",
    )
    g.add_argument(
        "--train-hang-timeout",
        type=float,
        default=None,
        help="seconds a train rank's step, save or weight sync may take before the rank counts as hung (default: "
        "no bound)",
    )
    g.add_argument(
        "--rollout-hang-timeout",
        type=float,
        default=None,
        help="seconds a RolloutManager call (a rollout, an eval, its save) may take before it counts as hung "
        "(default: no bound; agent rollouts can take an hour)",
    )


def validate_fault_args(args: argparse.Namespace) -> None:
    if args.max_restarts < 0:
        raise SlimeArgError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    for name in ("train_hang_timeout", "rollout_hang_timeout"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            raise SlimeArgError(f"--{name.replace('_', '-')} must be > 0 seconds, got {value}")
    if args.max_restarts and not args.save and not args.megatron_config:
        raise SlimeArgError("--max-restarts needs --save: a restart resumes from the newest complete checkpoint")
    if args.max_restarts and args.start_rollout_id is not None:
        raise SlimeArgError(
            "--max-restarts resumes each restart at its checkpoint's rollout; drop --start-rollout-id (it would "
            "replay from the same rollout every time)"
        )


def validate_cluster_args(args: argparse.Namespace) -> None:
    """Colocation and offload defaults (--colocate turns both offloads on), debug-rollout-only sizing."""
    validate_fault_args(args)
    env = args.train_env_vars
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise SlimeArgError('--train-env-vars must be a JSON object of strings, e.g. \'{"NCCL_DEBUG": "INFO"}\'')
    for name in ("actor_num_nodes", "actor_num_gpus_per_node", "rollout_num_gpus_per_engine", "num_gpus_per_node"):
        if getattr(args, name) < 1:
            raise SlimeArgError(f"--{name.replace('_', '-')} must be >= 1")
    if args.train_backend not in TRAIN_BACKENDS and "." not in args.train_backend:
        raise SlimeArgError(
            f"--train-backend {args.train_backend}: expected {' or '.join(TRAIN_BACKENDS)} or an import path "
            "package.module.Class"
        )
    actor_gpus = args.actor_num_nodes * args.actor_num_gpus_per_node
    if args.offload:
        args.offload_train = args.offload_rollout = True
    if args.debug_rollout_only:
        # Inference alone: no colocation, no offload, actors rewritten to the rollout size.
        args.colocate = False
        args.offload_train = args.offload_rollout = False
        if args.rollout_num_gpus is None:
            args.rollout_num_gpus = actor_gpus
        args.actor_num_gpus_per_node = min(args.num_gpus_per_node, args.rollout_num_gpus)
        args.actor_num_nodes = max(1, args.rollout_num_gpus // max(1, args.actor_num_gpus_per_node))
    elif args.colocate:
        args.offload_train = True if args.offload_train is None else args.offload_train
        args.offload_rollout = True if args.offload_rollout is None else args.offload_rollout
        if args.rollout_num_gpus is None:
            args.rollout_num_gpus = actor_gpus
    args.offload_train = bool(args.offload_train)
    args.offload_rollout = bool(args.offload_rollout) and not args.debug_train_only  # no engines to offload
    if args.actor_num_nodes > 1 and args.actor_num_gpus_per_node > args.num_gpus_per_node:
        raise SlimeArgError(
            f"--actor-num-gpus-per-node {args.actor_num_gpus_per_node} exceeds --num-gpus-per-node "
            f"{args.num_gpus_per_node}"
        )
    if not args.debug_train_only and not args.rollout_external:
        if args.rollout_num_gpus is None:
            raise SlimeArgError("--rollout-num-gpus is required unless --colocate, e.g. --rollout-num-gpus 2")
        if args.rollout_num_gpus % args.rollout_num_gpus_per_engine:
            raise SlimeArgError(
                f"--rollout-num-gpus ({args.rollout_num_gpus}) must be a multiple of --rollout-num-gpus-per-engine "
                f"({args.rollout_num_gpus_per_engine})"
            )
    if args.rollout_num_gpus is None:
        args.rollout_num_gpus = 0
    args.world_size = actor_gpus
