"""Train actors (one Ray actor per training GPU) and the group that drives them.

Until the Megatron trainer lands, a train actor initialises `torch.distributed` (gloo on CPU, NCCL on GPU),
receives its DP rank's share of each rollout and records a content hash of exactly what it received, so a
replayed rollout dump can be proven to reach the trainer unchanged. Under `--debug-rollout-only` the actors
exist (they hold their placement) but return before any process group is created (spec §3).
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import socket
from argparse import Namespace
from typing import Any

import ray

from slime.ray.placement import Placement

logger = logging.getLogger(__name__)

TRAIN_ACTOR_GPU = 0.4


def hash_train_data(data: dict[str, Any]) -> str:
    """A stable digest of one rank's train data (keys sorted; values pickled — lists, ints, floats, strings)."""
    h = hashlib.sha256()
    for key in sorted(data):
        h.update(key.encode())
        h.update(pickle.dumps(data[key], protocol=4))
    return h.hexdigest()


class TrainRayActor:
    def __init__(self, args: Namespace, rank: int, world_size: int, master_addr: str, master_port: int) -> None:
        self.args = args
        self.rank = rank
        self.world_size = world_size
        self.master_addr = master_addr
        self.master_port = master_port
        self.hashes: dict[int, str] = {}
        self.num_samples: dict[int, int] = {}

    def init(self) -> int:
        """Returns the first rollout id to run (from a checkpoint once checkpointing exists)."""
        start = self.args.start_rollout_id or 0
        if self.args.debug_rollout_only:
            return start  # before any torch.distributed call: inference alone needs no process group
        import torch
        import torch.distributed as dist

        backend = self.args.distributed_backend or ("nccl" if torch.cuda.is_available() else "gloo")
        os.environ["MASTER_ADDR"] = self.master_addr
        os.environ["MASTER_PORT"] = str(self.master_port)
        dist.init_process_group(backend=backend, rank=self.rank, world_size=self.world_size)
        return start

    def status(self) -> dict[str, Any]:
        import sys

        dist_initialized = False
        if "torch.distributed" in sys.modules:
            import torch.distributed as dist

            dist_initialized = dist.is_available() and dist.is_initialized()
        return {"rank": self.rank, "pid": os.getpid(), "dist_initialized": dist_initialized}

    def train(self, rollout_id: int, rank_data_refs: list[Any]) -> str | None:
        if self.args.debug_rollout_only:
            return None
        dp_rank = self.rank  # TP=PP=CP=1 until the Megatron trainer defines the DP rank
        data = ray.get(rank_data_refs[dp_rank])
        digest = hash_train_data(data)
        self.hashes[rollout_id] = digest
        self.num_samples[rollout_id] = len(data.get("tokens", []))
        logger.info(
            "rank %d rollout %d: %d samples, hash %s", self.rank, rollout_id, self.num_samples[rollout_id], digest[:12]
        )
        return digest

    def get_hashes(self) -> dict[int, str]:
        return dict(self.hashes)

    def parallel_config(self) -> dict[str, int]:
        return {"dp_size": self.world_size, "cp_size": 1, "vpp_size": 1, "microbatch_group_size_per_vp_stage": 1}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RayTrainGroup:
    """`actor_num_nodes * actor_num_gpus_per_node` train actors on the first bundles of the placement group."""

    def __init__(self, args: Namespace, placement: Placement) -> None:
        self.args = args
        n = args.actor_num_nodes * args.actor_num_gpus_per_node
        if args.debug_rollout_only:
            n = min(n, len(placement.bundle_indices))
        port = _free_port()
        cls = ray.remote(TrainRayActor)
        self.actors = [
            cls.options(num_gpus=TRAIN_ACTOR_GPU, num_cpus=0.01, scheduling_strategy=placement.strategy(i)).remote(
                args, i, n, "127.0.0.1", port
            )
            for i in range(n)
        ]

    def init(self) -> int:
        starts = ray.get([a.init.remote() for a in self.actors])
        return starts[0]

    def train(self, rollout_id: int, rank_data_refs: list[Any]) -> list[str | None]:
        return ray.get([a.train.remote(rollout_id, rank_data_refs) for a in self.actors])

    def status(self) -> list[dict[str, Any]]:
        return ray.get([a.status.remote() for a in self.actors])

    def get_hashes(self) -> list[dict[int, str]]:
        return ray.get([a.get_hashes.remote() for a in self.actors])

    def parallel_config(self) -> dict[str, int]:
        return ray.get(self.actors[0].parallel_config.remote())
