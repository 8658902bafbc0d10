"""Train actors (one Ray actor per training GPU) and the group that drives them.

Each actor owns one `MegatronTrainer` rank. It also records a content hash of exactly the train data it
received per rollout, so a replayed rollout dump can be proven to reach the trainer unchanged. Under
`--debug-rollout-only` the actors exist (they hold their placement) but return before any process group is
created: inference alone needs no training process group (docs/architecture.md#debug-modes).

Rank 0 binds the rendezvous on its own node's address; every rank joins it there, so the train ranks may span
nodes. Weight sync has two transports (`--update-weight-mode`): `tensor` for colocated engines (IPC handles
over HTTP, `weight_sync.py`) and `distributed` for engines on their own GPUs (a process group per pipeline
stage, `weight_sync_distributed.py`). With `--offload-train` the trainer sleeps between its own
phases (`offload.py`): it wakes to train or save and sleeps again. When a weight sync follows the train call,
it sleeps in two halves: optimizer state and grads at the end of the train call, its params only once the
sync has read them on the GPU (`keep_weights`), so the sync never waits for a host-to-device copy.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import pickle
import time
from argparse import Namespace
from collections.abc import Iterator
from typing import Any

import ray

from slime.ray.placement import Placement
from slime.utils.console import configure_actor
from slime.utils.http_utils import node_address
from slime.utils.misc import load_function
from slime.utils.process import forks_die_with_this_process

logger = logging.getLogger(__name__)

TRAIN_ACTOR_GPU = 0.4  # actor + critic (PPO) + a colocated engine (0.2) fit one GPU bundle
# --train-backend -> role -> the trainer class (one per training rank)
TRAIN_BACKENDS = {
    "megatron": {
        "actor": "slime.backends.megatron.trainer.MegatronTrainer",
        "critic": "slime.backends.megatron.critic.CriticTrainer",
    }
}


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
        forks_die_with_this_process()  # megatron's checkpoint writers must not outlive a killed actor
        self.log_path = configure_actor(args.log_level, args.metrics_dir, name)
        self.args = args
        self.role = role
        self.rank = rank
        self.world_size = world_size
        self.node_ip = node_address()
        self._listen: Any = None  # rank 0: the rendezvous socket, bound until the process group takes it
        self.rendezvous: tuple[str, int] | None = None
        self.hashes: dict[int, str] = {}
        self.num_samples: dict[int, int] = {}
        self.trainer = None
        self.weight_sync = None
        self.dist_sync = None
        self.offloader = None

    def rendezvous_address(self) -> tuple[str, int]:
        """Rank 0: (this node's address, a port bound on it now) for every rank to rendezvous at."""
        from slime.utils.distributed import listen_socket

        self._listen = listen_socket(self.node_ip)
        self.rendezvous = (self.node_ip, self._listen.getsockname()[1])
        return self.rendezvous

    def init(self, master_addr: str, master_port: int, load_path: str | None = None) -> int:
        """Build the trainer, resume from `load_path` if given; returns the first rollout id to run
        (the checkpoint's rollout + 1, unless --start-rollout-id says otherwise)."""
        start = self.args.start_rollout_id or 0
        if self.args.debug_rollout_only:
            return start  # before any torch.distributed call: inference alone needs no process group
        from slime.backends.megatron.offload import TrainOffloader

        trainer_cls = load_function(TRAIN_BACKENDS[self.args.train_backend][self.role])
        # with torch_memory_saver the trainer allocates into the offloader's regions (offload.py)
        self.offloader = TrainOffloader(bool(self.args.offload_train), legacy=self.args.legacy_offload)
        self.trainer = trainer_cls(
            self.args, self.rank, self.world_size, master_addr, master_port, node_ip=self.node_ip,
            listen=self._listen, offloader=self.offloader,
        )  # fmt: skip
        if load_path:
            from slime.backends.megatron.checkpoint import load_trainer_state

            with self.offloader.region("optimizer"):  # a loaded optimizer state may be new tensors
                meta = load_trainer_state(self.trainer, load_path)
            if self.args.start_rollout_id is None:
                start = int(meta["rollout_id"]) + 1
        import torch

        # every chunk's parameters (several only with virtual pipeline stages, which refuse --offload-train)
        chunks = self.trainer.chunks
        self.offloader.attach(chunks[0] if len(chunks) == 1 else torch.nn.ModuleList(chunks), self.trainer.optimizer)
        self.offloader.sleep()
        return start

    def status(self) -> dict[str, Any]:
        import sys

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

    def train(
        self,
        rollout_id: int,
        rank_data_refs: list[Any],
        values: list[list[float]] | None = None,
        keep_weights: bool = False,
    ) -> tuple[str | None, dict[str, float]]:
        """One rollout on this rank; `values` (PPO): the critic's old values from the critic rank of this rank.
        `keep_weights`: a weight sync comes next, which releases the params once it has read them."""
        if self.args.debug_rollout_only:
            return None, {}
        data = self._rank_data(rollout_id, rank_data_refs)
        with self._timed() as woke:
            self.offloader.wake_up()
        metrics = self.trainer.train(rollout_id, data, values)
        with self._timed() as slept:
            self.offloader.sleep(keep_weights=keep_weights)
        return self.hashes[rollout_id], {**metrics, **self._memory_metrics(), **self._wake_sleep(woke, slept)}

    def train_critic(
        self, rollout_id: int, rank_data_refs: list[Any]
    ) -> tuple[tuple[str, dict[str, float]], list[list[float]]]:
        """The critic's rollout (called with `num_returns=2`): the values ref goes straight to actor rank i."""
        data = self._rank_data(rollout_id, rank_data_refs)
        with self._timed() as woke:
            self.offloader.wake_up()
        metrics, values = self.trainer.train(rollout_id, data)
        with self._timed() as slept:
            self.offloader.sleep()
        return (
            self.hashes[rollout_id],
            {**metrics, **self._memory_metrics(), **self._wake_sleep(woke, slept)},
        ), values

    @staticmethod
    @contextlib.contextmanager
    def _timed() -> Iterator[list[float]]:
        box = [time.perf_counter()]
        yield box
        box[0] = time.perf_counter() - box[0]

    def _wake_sleep(self, woke: list[float], slept: list[float]) -> dict[str, float]:
        """Onload / offload time of this role's trainer (its share of `time/train_total`)."""
        if not self.offloader.enabled:
            return {}
        return {f"time/{self.role}_wake_up": woke[0], f"time/{self.role}_sleep": slept[0]}

    def _memory_metrics(self) -> dict[str, float]:
        """The sleeping trainer's host footprint as the ledger books it and as the OS sees it (offload.py)."""
        if not self.offloader.enabled:
            return {}
        rep = self.offloader.memory_report()
        params = sum(p.numel() for c in self.trainer.chunks for p in c.parameters())
        return {
            f"memory/{self.role}_host_asleep_bytes": float(sum(rep["host"].values())),
            f"memory/{self.role}_host_rss_asleep_bytes": float(rep["rss_asleep"]),
            f"memory/{self.role}_host_pinned_asleep_bytes": float(rep["pinned"]),
            f"memory/{self.role}_params": float(params),
        }

    def _rank_data(self, rollout_id: int, rank_data_refs: list[Any]) -> dict[str, Any]:
        data = ray.get(rank_data_refs[self.trainer.ps.rank("dp")])
        digest = hash_train_data(data)
        self.hashes[rollout_id] = digest
        self.num_samples[rollout_id] = len(data.get("tokens", []))
        logger.info(
            "%s rank %d rollout %d: %d samples, hash %s",
            self.role, self.rank, rollout_id, self.num_samples[rollout_id], digest[:12],
        )  # fmt: skip
        return data

    def update_weights(self, engines: list[dict[str, Any]], weight_version: int) -> dict[str, float]:
        """Every rank exports (a TP collective) and takes part; see the two transports' modules.

        `engines`: `{"url", "num_gpus", "base_gpu"}` of each receiving engine. Runs while the trainer sleeps (or,
        after `train(keep_weights=True)`, half-sleeps: then it reads the live weights and finishes the sleep)."""
        if self.args.debug_rollout_only or not engines:
            return self._release_weights() if self.offloader is not None else {}
        from slime.backends.megatron.initialize import run_custom_megatron_init

        run_custom_megatron_init(self.args)
        self.offloader.note("update_weights")
        try:
            if self.args.update_weight_mode == "distributed":
                out = self._update_weights_distributed(engines, weight_version)
            else:
                out = self._update_weights_tensor(engines, weight_version)
            if self.args.check_weight_update_equal:
                out.update(self._check_weights([e["url"] for e in engines]))
        finally:
            out_sleep = self._release_weights()
        return {**out, **out_sleep}

    def _release_weights(self) -> dict[str, float]:
        """The second half of a sleep that kept the weights for the sync (`train(keep_weights=True)`)."""
        if not self.offloader.drowsy:
            return {}
        with self._timed() as slept:
            self.offloader.sleep()
        return {f"time/{self.role}_release_weights": slept[0]}

    def _update_weights_tensor(self, engines: list[dict[str, Any]], weight_version: int) -> dict[str, float]:
        from slime.backends.megatron.weight_sync import ColocatedEngine, TensorWeightSync

        targets = [ColocatedEngine(e["url"], e["base_gpu"], e["num_gpus"]) for e in engines]
        if self.weight_sync is None or self.weight_sync.engines != targets:  # engines restarted: new groups
            if self.weight_sync is not None:
                self.weight_sync.close()
            self.weight_sync = TensorWeightSync(targets, self.args.update_weight_buffer_size)
        return self.weight_sync.sync(self.trainer.weights_for_sync(), weight_version)

    def _update_weights_distributed(self, engines: list[dict[str, Any]], weight_version: int) -> dict[str, float]:
        """Rank 0 pauses the engines and opens their weight-update session once; each stage's sender then
        broadcasts its layers over its own group; rank 0 closes the session when every stage is done."""
        import torch.distributed as dist

        from slime.backends.megatron.weight_sync_distributed import DistributedWeightSync, EngineTarget
        from slime.backends.sglang.client import SGLangClient, begin_weight_sync, end_weight_sync

        targets = [EngineTarget(e["url"], int(e["num_gpus"])) for e in engines]
        clients = [SGLangClient(t.url) for t in targets] if dist.get_rank() == 0 else []
        begin_weight_sync(clients)
        dist.barrier()
        named = self.trainer.export_hf()
        out: dict[str, float] = {}
        if self.trainer.is_weight_sender():
            if self.dist_sync is None:
                self.dist_sync = DistributedWeightSync(
                    pp_rank=self.trainer.ps.rank("pp"),
                    master_address=self.node_ip,
                    backend=self.args.distributed_backend,
                    bucket_bytes=self.args.update_weight_buffer_size,
                    timeout_s=60.0 * self.args.distributed_timeout_minutes,
                )
            self.dist_sync.connect(targets)
            t0 = time.perf_counter()  # conversion (the export generator) and broadcast: the sender's part
            out = self.dist_sync.send(named, weight_version)
            out["weight_sync/send_s"] = time.perf_counter() - t0
        else:
            for _ in named:  # take part in the TP gathers only
                pass
        dist.barrier()
        end_weight_sync(clients)
        for c in clients:
            c.close()
        return out

    def _check_weights(self, engine_urls: list[str]) -> dict[str, float]:
        """`--check-weight-update-equal`: every engine's per-tensor checksums equal the trainer's (all stages)."""
        import torch.distributed as dist

        from slime.backends.megatron.weight_hash import check_engines, engine_checksum_layout, trainer_weight_checksums

        layout = [engine_checksum_layout(engine_urls[0]) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(layout, src=0)  # every sender hashes as the engines do
        sums = trainer_weight_checksums(self.trainer, layout=layout[0])
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, sums)
        if dist.get_rank() != 0:
            return {}
        merged = {k: v for part in gathered if part for k, v in part.items()}
        return check_engines(engine_urls, merged)

    def save(self, path: str, rollout_id: int) -> None:
        """This rank's shard of the checkpoint (a collective: every rank calls it)."""
        if self.trainer is None:
            return
        from slime.backends.megatron.checkpoint import save_trainer_state
        from slime.backends.megatron.initialize import run_custom_megatron_init

        run_custom_megatron_init(self.args)
        keep = self.offloader.drowsy  # asleep as it was: a sync may still be due to read the live weights
        self.offloader.wake_up()
        save_trainer_state(self.trainer, path, rollout_id)
        self.offloader.sleep(keep_weights=keep)

    def offload_events(self) -> list[tuple[float, str]]:
        return list(self.offloader.events) if self.offloader is not None else []

    def get_hashes(self) -> dict[int, str]:
        return dict(self.hashes)

    def save_hf(self, path: str) -> None:
        if self.trainer is not None:
            from slime.backends.megatron.initialize import run_custom_megatron_init

            run_custom_megatron_init(self.args)
            keep = self.offloader.drowsy
            self.offloader.wake_up()
            self.trainer.save_hf(path)
            self.offloader.sleep(keep_weights=keep)

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


class RayTrainGroup:
    """One role's `actor_num_nodes * actor_num_gpus_per_node` train actors, rank i on logical GPU i."""

    def __init__(self, args: Namespace, placement: Placement, role: str = "actor") -> None:
        self.args = args
        self.role = role
        requests = train_gpu_requests(args, len(placement.bundle_indices))
        n = len(requests)
        cls = ray.remote(TrainRayActor)
        env = {"env_vars": dict(args.train_env_vars)} if args.train_env_vars else None
        self.actors = [
            cls.options(
                num_gpus=requests[i][role], num_cpus=0.01, scheduling_strategy=placement.strategy(i), runtime_env=env
            ).remote(args, i, n, role)
            for i in range(n)
        ]

    def init(self, load_path: str | None = None) -> int:
        """Rank 0 picks the rendezvous on its node; every rank joins there and builds its trainer."""
        master_addr, master_port = ray.get(self.actors[0].rendezvous_address.remote())
        starts = ray.get([a.init.remote(master_addr, master_port, load_path) for a in self.actors])
        return starts[0]

    def train(
        self,
        rollout_id: int,
        rank_data_refs: list[Any],
        values: list[Any] | None = None,
        keep_weights: bool = False,
    ) -> tuple[list[str | None], dict[str, float]]:
        """Returns every rank's data hash and rank 0's step metrics (already reduced over dp×cp). `values`: one
        Ray ref per rank (the critic's), resolved by Ray on the way to that rank, never through the driver."""
        out = ray.get([
            a.train.remote(rollout_id, rank_data_refs, values[i] if values is not None else None, keep_weights)
            for i, a in enumerate(self.actors)
        ])  # fmt: skip
        return [h for h, _ in out], with_rank_memory([m for _, m in out])

    def train_critic(self, rollout_id: int, rank_data_refs: list[Any]) -> tuple[list[Any], list[Any]]:
        """Start every critic rank; returns (per-rank refs of (hash, metrics), per-rank refs of old values)."""
        pairs = [a.train_critic.options(num_returns=2).remote(rollout_id, rank_data_refs) for a in self.actors]
        return [p[0] for p in pairs], [p[1] for p in pairs]

    def update_weights(self, engines: list[dict[str, Any]], weight_version: int) -> dict[str, float]:
        out = ray.get([a.update_weights.remote(engines, weight_version) for a in self.actors])
        merged: dict[str, float] = {}
        for m in out:
            merged.update(m)
        return merged

    def status(self) -> list[dict[str, Any]]:
        return ray.get([a.status.remote() for a in self.actors])

    def save_hf(self, path: str) -> None:
        ray.get([a.save_hf.remote(path) for a in self.actors])

    def save(self, path: str, rollout_id: int) -> None:
        ray.get([a.save.remote(path, rollout_id) for a in self.actors])

    def offload_events(self) -> list[tuple[float, str]]:
        """Rank 0's sleep / wake_up / update_weights calls, with times (the offload protocol's train side)."""
        return ray.get(self.actors[0].offload_events.remote())

    def get_hashes(self) -> list[dict[int, str]]:
        return ray.get([a.get_hashes.remote() for a in self.actors])

    def parallel_config(self) -> dict[str, int]:
        return ray.get(self.actors[0].parallel_config.remote())


class TrainModels:
    """What the driver trains: the actor group and, with PPO, the critic group on the same GPU bundles.

    Each role runs on its own copy of the args (`--megatron-config`, slime/backends/megatron/roles.py). Per
    rollout the critic goes first (old values, then its value-loss steps); its per-rank value refs are handed to
    the actor ranks of the same index. For the first `--num-critic-only-steps` rollouts the actor does not train
    (its weights stay as they are and are still synced). The critic checkpoints into its own directory, before
    the actor, so a complete actor checkpoint always has its critic.
    """

    def __init__(self, args: Namespace, placement: Placement) -> None:
        from slime.backends.megatron.roles import role_args

        self.args = args
        self.actor_args = role_args(args, "actor")
        self.critic_args = role_args(args, "critic") if "critic" in train_roles(args) else None
        self.critic = RayTrainGroup(self.critic_args, placement, "critic") if self.critic_args else None
        self.actor = RayTrainGroup(self.actor_args, placement, "actor")

    def init(self, resume: tuple[int, str] | None) -> int:
        """Build (and resume) every role; returns the first rollout id, as the actor's checkpoint says."""
        if self.critic is not None:
            self.critic.init(self._critic_resume(resume))
        return self.actor.init(resume[1] if resume else None)

    def _critic_resume(self, resume: tuple[int, str] | None) -> str | None:
        """The actor's rollout when it resumes (the critic must have it), else the critic dir's newest, if any."""
        from slime.utils import checkpoint_dirs as checkpoint

        assert self.critic_args is not None
        root = self.critic_args.load
        if resume is None:
            found = checkpoint.find_checkpoint(root)
            return found[1] if found else None
        path = checkpoint.iter_dir(root, resume[0]) if root else None
        if path is None or not os.path.isfile(os.path.join(path, checkpoint.MARKER)):
            raise RuntimeError(
                f"the actor resumes from rollout {resume[0]} but the critic has no complete checkpoint of it in "
                f"{root} (--critic-load, default critic/ under --load)"
            )
        return path

    def train(
        self, rollout_id: int, rank_data_refs: list[Any], keep_weights: bool = False
    ) -> tuple[list[str | None], dict[str, float]]:
        """`keep_weights`: the actor's weight sync follows (`TrainRayActor.train`)."""
        if self.critic is None:
            return self.actor.train(rollout_id, rank_data_refs, keep_weights=keep_weights)
        stat_refs, value_refs = self.critic.train_critic(rollout_id, rank_data_refs)
        stats = ray.get(stat_refs)
        metrics = with_rank_memory([m for _, m in stats])
        if rollout_id < self.args.num_critic_only_steps:
            metrics["train/critic_only"] = 1.0
            return [h for h, _ in stats], metrics
        hashes, actor_metrics = self.actor.train(rollout_id, rank_data_refs, value_refs, keep_weights)
        return hashes, {**metrics, **actor_metrics}

    def save(self, path: str, rollout_id: int) -> None:
        """The critic's checkpoint (complete, in its own dir) first, then the actor's shards into `path`."""
        if self.critic is not None:
            from slime.utils import checkpoint_dirs as checkpoint

            assert self.critic_args is not None
            root = self.critic_args.save
            if root:
                tmp = checkpoint.begin_save(root, rollout_id)
                self.critic.save(tmp, rollout_id)
                checkpoint.finish_save(root, rollout_id, {"rollout_id": rollout_id, "role": "critic"})
        self.actor.save(path, rollout_id)

    def update_weights(self, engines: list[dict[str, Any]], weight_version: int) -> dict[str, float]:
        return self.actor.update_weights(engines, weight_version)

    def status(self) -> list[dict[str, Any]]:
        return self.actor.status()

    def save_hf(self, path: str) -> None:
        self.actor.save_hf(path)

    def offload_events(self) -> list[tuple[float, str]]:
        return self.actor.offload_events()

    def parallel_config(self) -> dict[str, int]:
        return self.actor.parallel_config()
