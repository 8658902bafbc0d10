"""Every train actor of a run, by role, and the per-rollout order of the roles: the one group the driver trains.

The actor's ranks and, with PPO, the critic's on the same GPU bundles (rank i of every role on bundle i), each
role on its own copy of the args (`--megatron-config`, slime/backends/megatron/roles.py). Per rollout the critic
goes first (old values, then its value-loss steps); its per-rank value refs go to the actor ranks of the same
index, resolved by Ray on the way to that rank, never through the driver. For the first
`--num-critic-only-steps` rollouts the actor does not train (its weights stay as they are and are still
synced). The critic checkpoints into its own directory, before the actor, so a complete actor checkpoint always
has its critic. The engines receive the actor's weights.
"""

from __future__ import annotations

import os
from argparse import Namespace
from typing import Any

import ray

from slime.backends.megatron.roles import role_args
from slime.ray.actor_faults import get_within
from slime.ray.placement import Placement
from slime.ray.train_actor import TrainRayActor
from slime.utils import checkpoint_dirs

TRAIN_ACTOR_GPU = 0.4  # actor + critic (PPO) + a colocated engine (0.2) fit one GPU bundle


def train_roles(args: Namespace) -> list[str]:
    """The trained models, in creation order: PPO's critic first (as in slime), then the actor."""
    if args.advantage_estimator == "ppo" and not args.debug_rollout_only:
        return ["critic", "actor"]
    return ["actor"]


def train_gpu_requests(args: Namespace, num_bundles: int) -> dict[int, dict[str, float]]:
    """{bundle: {role: fraction of its GPU}} the train actors ask Ray for: rank i of every role sits on bundle i.

    The critic lives on the actor's bundles, so PPO needs no GPU that GRPO does not (time-shared through offload)."""
    n = args.actor_num_nodes * args.actor_num_gpus_per_node
    if args.debug_rollout_only:
        n = min(n, num_bundles)
    return {i: dict.fromkeys(train_roles(args), TRAIN_ACTOR_GPU) for i in range(n)}


def with_rank_memory(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """Rank 0's metrics, plus every other rank's `memory/*` as `memory/rank{r}/*`.

    Why: the step's losses are already reduced, but memory is per GPU — ranks differ (the distributed optimizer's
    shard sizes, uneven micro-batches), and a plan is checked against every rank, not only the first."""
    merged = dict(per_rank[0])
    for r, metrics in enumerate(per_rank[1:], start=1):
        merged.update(
            {f"memory/rank{r}/{k[len('memory/') :]}": v for k, v in metrics.items() if k.startswith("memory/")}
        )
    return merged


class TrainGroup:
    def __init__(self, args: Namespace, placement: Placement) -> None:
        self.args = args
        self.role_args = {role: role_args(args, role) for role in train_roles(args)}
        requests = train_gpu_requests(args, len(placement.bundle_indices))
        n = len(requests)
        cls = ray.remote(TrainRayActor)
        env = {"env_vars": dict(args.train_env_vars)} if args.train_env_vars else None
        self.ranks = {
            role: [
                cls.options(
                    num_gpus=requests[i][role], num_cpus=0.01, scheduling_strategy=placement.strategy(i),
                    runtime_env=env,
                ).remote(rargs, i, n, role)
                for i in range(n)
            ]
            for role, rargs in self.role_args.items()
        }  # fmt: skip

    def _call(self, role: str, method: str, *args: Any) -> list[Any]:
        """`TrainBackend.method(*args)` on every rank of `role`; their answers in rank order."""
        return self._get(role, [a.call.remote(method, *args) for a in self.ranks[role]], method)

    def _get(self, role: str, refs: list[Any], call: str) -> list[Any]:
        """The ranks' answers; a dead rank raises at once, a rank late by --train-hang-timeout as hung."""
        names = [f"train_rank{i}" if role == "actor" else f"{role}_rank{i}" for i in range(len(refs))]
        return get_within(refs, self.args.train_hang_timeout, names, call)

    # ---- start-up -------------------------------------------------------------------------------------------
    def init(self, resume: tuple[int, str] | None) -> int:
        """Build (and resume) every role; returns the first rollout id, as the actor's checkpoint says."""
        if "critic" in self.ranks:
            self._init("critic", self._critic_resume(resume))
        return self._init("actor", resume[1] if resume else None)

    def _init(self, role: str, load_path: str | None) -> int:
        """Rank 0 picks the rendezvous on its node; every rank joins there and builds its backend."""
        actors = self.ranks[role]
        master_addr, master_port = ray.get(actors[0].rendezvous_address.remote())
        return ray.get([a.init.remote(master_addr, master_port, load_path) for a in actors])[0]

    def _critic_resume(self, resume: tuple[int, str] | None) -> str | None:
        """The actor's rollout when it resumes (the critic must have it), else the critic dir's newest, if any."""
        root = self.role_args["critic"].load
        if resume is None:
            found = checkpoint_dirs.find_checkpoint(root)
            return found[1] if found else None
        path = checkpoint_dirs.iter_dir(root, resume[0]) if root else None
        if path is None or not os.path.isfile(os.path.join(path, checkpoint_dirs.MARKER)):
            raise RuntimeError(
                f"the actor resumes from rollout {resume[0]} but the critic has no complete checkpoint of it in "
                f"{root} (--critic-load, default critic/ under --load)"
            )
        return path

    # ---- per rollout ----------------------------------------------------------------------------------------
    def _start_train(
        self, role: str, rollout_id: int, rank_data_refs: list[Any], values: list[Any] | None, keep_weights: bool
    ) -> tuple[list[Any], list[Any]]:
        """Start every rank of `role`; returns (refs of each rank's (hash, metrics), refs of what it hands on)."""
        pairs = [
            a.train.options(num_returns=2).remote(
                rollout_id, rank_data_refs, values[i] if values is not None else None, keep_weights
            )
            for i, a in enumerate(self.ranks[role])
        ]
        return [p[0] for p in pairs], [p[1] for p in pairs]

    def train(
        self, rollout_id: int, rank_data_refs: list[Any], keep_weights: bool = False
    ) -> tuple[list[str], dict[str, float]]:
        """Every rank's data hash and rank 0's step metrics (already reduced over dp×cp), every rank's memory.
        `keep_weights`: the actor's weight sync follows (`TrainBackend.train`)."""
        metrics: dict[str, float] = {}
        values = None
        if "critic" in self.ranks:
            stat_refs, values = self._start_train("critic", rollout_id, rank_data_refs, None, False)
            stats = self._get("critic", stat_refs, "train")
            metrics = with_rank_memory([m for _, m in stats])
            if rollout_id < self.args.num_critic_only_steps:
                return [h for h, _ in stats], {**metrics, "train/critic_only": 1.0}
        stat_refs, _ = self._start_train("actor", rollout_id, rank_data_refs, values, keep_weights)
        stats = self._get("actor", stat_refs, "train")
        return [h for h, _ in stats], {**metrics, **with_rank_memory([m for _, m in stats])}

    def save(self, path: str, rollout_id: int) -> None:
        """The critic's checkpoint (complete, in its own dir) first, then the actor's shards into `path`."""
        root = self.role_args["critic"].save if "critic" in self.ranks else None
        if root:
            tmp = checkpoint_dirs.begin_save(root, rollout_id)
            self._call("critic", "save", tmp, rollout_id)
            checkpoint_dirs.finish_save(root, rollout_id, {"rollout_id": rollout_id, "role": "critic"})
        self._call("actor", "save", path, rollout_id)

    def save_hf(self, path: str) -> None:
        self._call("actor", "save_hf", path)

    def update_weights(self, engines: list[dict[str, Any]], weight_version: int) -> dict[str, float]:
        merged: dict[str, float] = {}
        for m in self._call("actor", "update_weights", engines, weight_version):
            merged.update(m)
        return merged

    # ---- what the driver reports ----------------------------------------------------------------------------
    def status(self) -> list[dict[str, Any]]:
        return ray.get([a.status.remote() for a in self.ranks["actor"]])

    def parallel_config(self) -> dict[str, int]:
        return ray.get(self.ranks["actor"][0].call.remote("parallel_config"))

    def offload_events(self) -> list[tuple[float, str]]:
        """Actor rank 0's sleep / wake_up / update_weights calls, with times (the offload protocol's train side)."""
        return ray.get(self.ranks["actor"][0].call.remote("offload_events"))
