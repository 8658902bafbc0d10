"""The train actor: one Ray actor per training GPU and role, the generic host of that rank's `TrainBackend`.

It knows nothing of how the rank trains (`slime/backends/train_backend.py`): it gives the backend its rank, the
rendezvous and its node's address, fetches its share of each rollout's train data from the object store and
hashes exactly what it received (`train` returns the hash, so a replayed rollout dump can be proven to reach the
trainer unchanged). Every other call goes to the backend as it is (`call`).

Rank 0 binds the rendezvous on its own node's address; every rank joins it there, so the train ranks may span
nodes. Under `--debug-rollout-only` the actors exist (they hold their placement) but their backend is the idle
one: inference alone needs no training process group (docs/architecture.md#debug-modes).
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import sys
from argparse import Namespace
from typing import Any

import ray

from slime.backends.train_backend import RankPlace, train_backend_class
from slime.utils import faults
from slime.utils.console import configure_actor
from slime.utils.http_utils import node_address
from slime.utils.process import forks_die_with_this_process

logger = logging.getLogger(__name__)
FAULT_POINTS = {"save": "save", "update_weights": "weight_sync"}  # backend calls -> fault points


def hash_train_data(data: dict[str, Any]) -> str:
    """A stable digest of one rank's train data (keys sorted; values pickled — lists, ints, floats, strings)."""
    h = hashlib.sha256()
    for key in sorted(data):
        h.update(key.encode())
        h.update(pickle.dumps(data[key], protocol=4))
    return h.hexdigest()


class TrainRayActor:
    def __init__(self, args: Namespace, rank: int, world_size: int, role: str = "actor") -> None:
        name = f"train_rank{rank}" if role == "actor" else f"{role}_rank{rank}"
        forks_die_with_this_process()  # a backend's checkpoint writers must not outlive a killed actor
        self.log_path = configure_actor(args.log_level, args.metrics_dir, name)
        self.args = args
        self.role = role
        self._fault_kind = "train" if role == "actor" else role  # slime/utils/faults.py
        self.rank = rank
        self.world_size = world_size
        self.node_ip = node_address()
        self._listen: Any = None  # rank 0: the rendezvous socket, bound until the process group takes it
        self.rendezvous: tuple[str, int] | None = None
        self.backend = train_backend_class(args)(args, role)

    def rendezvous_address(self) -> tuple[str, int]:
        """Rank 0: (this node's address, a port bound on it now) for every rank to rendezvous at."""
        from slime.utils.distributed import listen_socket

        self._listen = listen_socket(self.node_ip)
        self.rendezvous = (self.node_ip, self._listen.getsockname()[1])
        return self.rendezvous

    def init(self, master_addr: str, master_port: int, load_path: str | None = None) -> int:
        """Build the backend, resume from `load_path` if given; returns the first rollout id to run
        (the checkpoint's rollout + 1, unless --start-rollout-id says otherwise)."""
        place = RankPlace(self.rank, self.world_size, (master_addr, master_port), self.node_ip, self._listen)
        loaded = self.backend.build(place, load_path)
        if loaded is not None and self.args.start_rollout_id is None:
            return loaded + 1
        return self.args.start_rollout_id or 0

    def train(
        self, rollout_id: int, rank_data_refs: list[Any], values: list[list[float]] | None, keep_weights: bool
    ) -> tuple[tuple[str, dict[str, float]], list[list[float]] | None]:
        """One rollout on this rank (called with `num_returns=2`, so the critic's values ref can go straight to
        actor rank i): ((data hash, metrics), the values the role hands on)."""
        data = ray.get(rank_data_refs[self.backend.dp_rank()])
        digest = hash_train_data(data)
        logger.info(
            "%s rank %d rollout %d: %d samples, hash %s",
            self.role, self.rank, rollout_id, len(data.get("tokens", [])), digest[:12],
        )  # fmt: skip
        metrics, handed_on = self.backend.train(rollout_id, data, values, keep_weights)
        faults.inject(self._fault_kind, "train_step")  # weights stepped, the driver not told: the worst moment
        return (digest, metrics), handed_on

    def call(self, method: str, *args: Any) -> Any:
        """Any other `TrainBackend` call, as it is (save, save_hf, update_weights, parallel_config, ...)."""
        out = getattr(self.backend, method)(*args)
        if method in FAULT_POINTS:
            faults.inject(self._fault_kind, FAULT_POINTS[method])  # done here, not yet reported: mid-save, mid-sync
        return out

    def status(self) -> dict[str, Any]:
        dist_initialized = False
        if "torch.distributed" in sys.modules:
            import torch.distributed as dist

            dist_initialized = dist.is_available() and dist.is_initialized()
        return {
            "rank": self.rank,
            "pid": os.getpid(),
            "node_ip": self.node_ip,
            "rendezvous": self.rendezvous,
            "dist_initialized": dist_initialized,
            "env": {k: os.environ.get(k) for k in self.args.train_env_vars},  # --train-env-vars as the rank sees them
        }
