"""`MegatronBackend`: the `TrainBackend` (slime/backends/train_backend.py) on megatron-core, for every role.

One per train rank and role: the role's trainer (`MegatronTrainer` for the actor — which also holds the reference
and teacher weights it scores against — `CriticTrainer` for PPO's critic), its offloader, its checkpoints and
the weight-sync transport of `--update-weight-mode`.

With `--offload-train` the trainer sleeps between its own phases (`offload.py`): it wakes to train or save and
sleeps again (`_awake`, the one place that does). When a weight sync follows the train call, it sleeps in two
halves: optimizer state and grads at the end of the train call, its params only once the sync has read them on
the GPU (`keep_weights`), so the sync never waits for a host-to-device copy.
"""

from __future__ import annotations

import contextlib
import logging
import time
from argparse import Namespace
from collections.abc import Iterator
from typing import Any

import torch

from slime.backends.megatron.checkpoint import load_trainer_state, save_trainer_state
from slime.backends.megatron.critic import CriticTrainer
from slime.backends.megatron.initialize import run_custom_megatron_init
from slime.backends.megatron.offload import TrainOffloader
from slime.backends.megatron.trainer import MegatronTrainer
from slime.backends.megatron.weight_hash import check_trainer_on_engines
from slime.backends.megatron.weight_sync import TensorTransport
from slime.backends.megatron.weight_sync_distributed import DistributedTransport
from slime.backends.train_backend import RankPlace

logger = logging.getLogger(__name__)

TRAINERS = {"actor": MegatronTrainer, "critic": CriticTrainer}


class MegatronBackend:
    def __init__(self, args: Namespace, role: str) -> None:
        self.args = args
        self.role = role
        # with torch_memory_saver the trainer allocates into the offloader's regions (offload.py)
        self.offloader = TrainOffloader(bool(args.offload_train), legacy=args.legacy_offload)
        self.trainer: MegatronTrainer | None = None
        self.transport: TensorTransport | DistributedTransport | None = None

    def build(self, place: RankPlace, load_path: str | None) -> int | None:
        args = self.args
        self.trainer = TRAINERS[self.role](
            args, place.rank, place.world_size, *place.master, node_ip=place.node_ip, listen=place.listen,
            offloader=self.offloader,
        )  # fmt: skip
        if args.update_weight_mode == "distributed":
            self.transport = DistributedTransport(args, place.node_ip)
        else:
            self.transport = TensorTransport(args.update_weight_buffer_size, args.update_weights_in_flight)
        loaded = None
        if load_path:
            with self.offloader.region("optimizer"):  # a loaded optimizer state may be new tensors
                loaded = int(load_trainer_state(self.trainer, load_path)["rollout_id"])
        # every chunk's parameters (several only with virtual pipeline stages, which refuse --offload-train)
        chunks = self.trainer.chunks
        self.offloader.attach(chunks[0] if len(chunks) == 1 else torch.nn.ModuleList(chunks), self.trainer.optimizer)
        self.sleep()
        return loaded

    def dp_rank(self) -> int:
        return self.trainer.ps.rank("dp")

    # ---- offload ------------------------------------------------------------------------------------------
    def sleep(self, keep_weights: bool = False) -> None:
        self.offloader.sleep(keep_weights=keep_weights)

    def wake_up(self) -> None:
        self.offloader.wake_up()

    @contextlib.contextmanager
    def _awake(self, keep_weights: bool | None = None) -> Iterator[dict[str, float]]:
        """Awake for the block, asleep after it; yields the wake-up and sleep times (this role's share of the
        call). `keep_weights` None: asleep as it was — half asleep when a sync is still due to read the weights."""
        keep = self.offloader.drowsy if keep_weights is None else keep_weights
        times: dict[str, float] = {}
        t0 = time.perf_counter()
        self.wake_up()
        t1 = time.perf_counter()
        yield times
        t2 = time.perf_counter()
        self.sleep(keep_weights=keep)
        if self.offloader.enabled:
            times.update({f"time/{self.role}_wake_up": t1 - t0, f"time/{self.role}_sleep": time.perf_counter() - t2})

    def _release_weights(self) -> dict[str, float]:
        """The second half of a sleep that kept the weights for the sync (`train(keep_weights=True)`)."""
        if not self.offloader.drowsy:
            return {}
        t0 = time.perf_counter()
        self.sleep()
        return {f"time/{self.role}_release_weights": time.perf_counter() - t0}

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

    # ---- the RL step -----------------------------------------------------------------------------------------
    def train(
        self, rollout_id: int, data: dict[str, Any], values: list[list[float]] | None, keep_weights: bool
    ) -> tuple[dict[str, float], list[list[float]] | None]:
        """`keep_weights`: a weight sync comes next, which releases the params once it has read them."""
        with self._awake(keep_weights) as times:
            metrics, old_values = self.trainer.train_rollout(rollout_id, data, values)
        return {**metrics, **self._memory_metrics(), **times}, old_values

    # ---- weights --------------------------------------------------------------------------------------------
    def update_weights(self, engines: list[dict[str, Any]], weight_version: int) -> dict[str, float]:
        """Every rank exports (a TP collective) and takes part. Runs while the trainer sleeps (or, after
        `train(keep_weights=True)`, half-sleeps: then it reads the live weights and finishes the sleep)."""
        if not engines:
            return self._release_weights()
        run_custom_megatron_init(self.args)
        self.offloader.note("update_weights")
        try:
            out = self.transport.sync(self.trainer, engines, weight_version)
            if self.args.check_weight_update_equal:
                out.update(check_trainer_on_engines(self.trainer, [e["url"] for e in engines]))
        finally:
            released = self._release_weights()
        return {**out, **released}

    # ---- checkpoints ----------------------------------------------------------------------------------------
    def save(self, path: str, rollout_id: int) -> None:
        """This rank's shard of the checkpoint (a collective: every rank calls it)."""
        run_custom_megatron_init(self.args)
        with self._awake():
            save_trainer_state(self.trainer, path, rollout_id)

    def save_hf(self, path: str) -> None:
        run_custom_megatron_init(self.args)
        with self._awake():
            self.trainer.save_hf(path)

    def parallel_config(self) -> dict[str, int]:
        ps = self.trainer.ps
        return {
            "dp_size": ps.size("dp"),
            "cp_size": ps.size("cp"),
            "pp_size": ps.size("pp"),
            "vpp_size": self.args.virtual_pipeline_model_parallel_size or 1,
            "microbatch_group_size_per_vp_stage": self.args.microbatch_group_size_per_vp_stage,
        }

    def offload_events(self) -> list[tuple[float, str]]:
        return list(self.offloader.events)
