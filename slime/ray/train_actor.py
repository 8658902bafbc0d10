"""Train actors (one Ray actor per training GPU) and the group that drives them.

Each actor owns one `MegatronTrainer` rank. It also records a content hash of exactly the train data it
received per rollout, so a replayed rollout dump can be proven to reach the trainer unchanged. Under
`--debug-rollout-only` the actors exist (they hold their placement) but return before any process group is
created (spec §3).
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
        self.trainer = None
        self.weight_sync = None

    def init(self) -> int:
        """Returns the first rollout id to run (from a checkpoint once checkpointing exists)."""
        start = self.args.start_rollout_id or 0
        if self.args.debug_rollout_only:
            return start  # before any torch.distributed call: inference alone needs no process group
        from slime.backends.megatron.trainer import MegatronTrainer

        self.trainer = MegatronTrainer(self.args, self.rank, self.world_size, self.master_addr, self.master_port)
        return start

    def status(self) -> dict[str, Any]:
        import sys

        dist_initialized = False
        if "torch.distributed" in sys.modules:
            import torch.distributed as dist

            dist_initialized = dist.is_available() and dist.is_initialized()
        return {"rank": self.rank, "pid": os.getpid(), "dist_initialized": dist_initialized}

    def train(self, rollout_id: int, rank_data_refs: list[Any]) -> tuple[str | None, dict[str, float]]:
        if self.args.debug_rollout_only:
            return None, {}
        data = ray.get(rank_data_refs[self.trainer.ps.rank("dp")])
        digest = hash_train_data(data)
        self.hashes[rollout_id] = digest
        self.num_samples[rollout_id] = len(data.get("tokens", []))
        logger.info(
            "rank %d rollout %d: %d samples, hash %s", self.rank, rollout_id, self.num_samples[rollout_id], digest[:12]
        )
        return digest, self.trainer.train(rollout_id, data)

    def update_weights(self, engine_urls: list[str], weight_version: int) -> dict[str, float]:
        """Every rank exports (a TP collective); the sender rank of each stage pushes to the engines."""
        if self.args.debug_rollout_only or not engine_urls:
            return {}
        from slime.backends.megatron.initialize import run_custom_megatron_init
        from slime.backends.megatron.weight_sync import TensorWeightSync

        run_custom_megatron_init(self.args)
        bucket_bytes = self.args.update_weight_buffer_size
        buckets = self.trainer.export_hf(bucket_bytes)
        if not self.trainer.is_weight_sender():
            for _ in buckets:  # take part in the TP gathers only
                pass
            return {}
        if self.weight_sync is None:
            self.weight_sync = TensorWeightSync(bucket_bytes=bucket_bytes)
        named = (item for bucket in buckets for item in bucket)
        return self.weight_sync.sync(engine_urls, named, weight_version)

    def get_hashes(self) -> dict[int, str]:
        return dict(self.hashes)

    def save_hf(self, path: str) -> None:
        if self.trainer is not None:
            from slime.backends.megatron.initialize import run_custom_megatron_init

            run_custom_megatron_init(self.args)
            self.trainer.save_hf(path)

    def parallel_config(self) -> dict[str, int]:
        if self.trainer is None:  # --debug-rollout-only: nothing trains, any layout will do
            return {"dp_size": 1, "cp_size": 1}
        ps = self.trainer.ps
        return {
            "dp_size": ps.size("dp"),
            "cp_size": ps.size("cp"),
            "pp_size": ps.size("pp"),
            "vpp_size": self.args.virtual_pipeline_model_parallel_size or 1,
            "microbatch_group_size_per_vp_stage": self.args.microbatch_group_size_per_vp_stage,
        }


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

    def train(self, rollout_id: int, rank_data_refs: list[Any]) -> tuple[list[str | None], dict[str, float]]:
        """Returns every rank's data hash and rank 0's step metrics (already reduced over dp×cp)."""
        out = ray.get([a.train.remote(rollout_id, rank_data_refs) for a in self.actors])
        return [h for h, _ in out], out[0][1]

    def update_weights(self, engine_urls: list[str], weight_version: int) -> dict[str, float]:
        out = ray.get([a.update_weights.remote(engine_urls, weight_version) for a in self.actors])
        merged: dict[str, float] = {}
        for m in out:
            merged.update(m)
        return merged

    def status(self) -> list[dict[str, Any]]:
        return ray.get([a.status.remote() for a in self.actors])

    def save_hf(self, path: str) -> None:
        ray.get([a.save_hf.remote(path) for a in self.actors])

    def get_hashes(self) -> list[dict[int, str]]:
        return ray.get([a.get_hashes.remote() for a in self.actors])

    def parallel_config(self) -> dict[str, int]:
        return ray.get(self.actors[0].parallel_config.remote())
