"""The training seam: what one train rank of one role does, whatever trains it.

(docs/architecture.md#the-training-seam)

The Ray side (`slime/ray/train_actor.py`) hosts one `TrainBackend` per train rank and role and knows nothing of
how it trains: it rendezvouses the ranks, fetches each rank's train data, records what it received, and calls
the methods below. `--train-backend` picks the class: a name in `TRAIN_BACKENDS`, or an import path
`package.module.Class` — how a new backend (FSDP, say) plugs in without a change to slime.

Roles: `actor` (the policy the engines serve) and `critic` (PPO's value model, on the actor's GPUs with the
actor's rank layout, so critic rank i feeds actor rank i). A backend is built for one role, with that role's
args (`--megatron-config` overrides, `slime/backends/megatron/roles.py`). The frozen models the actor scores
against — the reference policy (`--ref-load`, KL) and the distillation teacher (`--opd-teacher-load`) — are
weight sets the actor's backend holds and swaps in for their log-prob passes, not ranks of their own.

One rollout, per role: `train(rollout_id, data, values, keep_weights)` first computes what the role needs from
its current weights — the actor π_old and the frozen models' log-probs, the critic its old values — then runs
the role's optimizer steps. The critic returns its old values per sample; actor rank i receives critic rank i's
as `values`. A backend that offloads (`--offload-train`) sleeps between calls: each call wakes it as far as it
needs and leaves it asleep, and `keep_weights` (a weight sync follows) lets the train call keep the weights
where the sync will read them; `update_weights` then sends them — both transports, `--update-weight-mode` —
and finishes the sleep.
"""

from __future__ import annotations

import socket
from argparse import Namespace
from dataclasses import dataclass
from typing import Any, Protocol

from slime.utils.misc import load_function

# --train-backend name -> the class, by import path (a module is imported only when its backend is used)
TRAIN_BACKENDS = {"megatron": "slime.backends.megatron.backend.MegatronBackend"}


@dataclass(frozen=True)
class RankPlace:
    """Where one train rank joins its role's process group."""

    rank: int
    world_size: int
    master: tuple[str, int]  # the rendezvous, served by rank 0
    node_ip: str  # this rank's node address: its own listening sockets bind it
    listen: socket.socket | None = None  # rank 0: the socket bound at `master`, until the process group takes it


class TrainBackend(Protocol):
    """One train rank of one role. Built as `cls(args, role)` (the role's args), then `build`; every method is
    called on every rank of the role (most are collectives)."""

    def build(self, place: RankPlace, load_path: str | None) -> int | None:
        """Join the process group, build the model, load the checkpoint at `load_path` if given, then sleep;
        returns the loaded rollout id."""
        ...

    def dp_rank(self) -> int:
        """Which rank's share of the train data this rank trains on."""
        ...

    def train(
        self, rollout_id: int, data: dict[str, Any], values: list[list[float]] | None, keep_weights: bool
    ) -> tuple[dict[str, float], list[list[float]] | None]:
        """One rollout: (step metrics reduced over the data-parallel ranks, the critic's old values or None)."""
        ...

    def update_weights(self, engines: list[dict[str, Any]], weight_version: int) -> dict[str, float]:
        """Send the weights to `engines` (`{"url", "num_gpus", "base_gpu"}` each), as `weight_version`."""
        ...

    def save(self, path: str, rollout_id: int) -> None:
        """This rank's part of the checkpoint in `path` (a directory the driver began)."""
        ...

    def save_hf(self, path: str) -> None:
        """The model as an HF checkpoint `transformers` loads."""
        ...

    def sleep(self, keep_weights: bool = False) -> None:
        """Give the GPU back (what is kept, and where, is the backend's offload policy)."""
        ...

    def wake_up(self) -> None: ...

    def parallel_config(self) -> dict[str, int]:
        """The layout the rollout side splits train data by: `dp_size`, `cp_size`, `pp_size`, `vpp_size`,
        `microbatch_group_size_per_vp_stage`."""
        ...

    def offload_events(self) -> list[tuple[float, str]]:
        """(time, sleep / wake_up / update_weights ...): the offload protocol as this rank ran it."""
        ...


class IdleBackend:
    """A rank with nothing to train (`--debug-rollout-only`): it holds its placement and never touches
    `torch.distributed`, so inference alone needs no training process group."""

    def __init__(self, args: Namespace, role: str) -> None:
        self.role = role

    def build(self, place: RankPlace, load_path: str | None) -> int | None:
        return None

    def dp_rank(self) -> int:
        return 0

    def train(
        self, rollout_id: int, data: dict[str, Any], values: list[list[float]] | None, keep_weights: bool
    ) -> tuple[dict[str, float], list[list[float]] | None]:
        return {}, None

    def update_weights(self, engines: list[dict[str, Any]], weight_version: int) -> dict[str, float]:
        return {}

    def save(self, path: str, rollout_id: int) -> None:
        pass

    def save_hf(self, path: str) -> None:
        pass

    def sleep(self, keep_weights: bool = False) -> None:
        pass

    def wake_up(self) -> None:
        pass

    def parallel_config(self) -> dict[str, int]:
        return {"dp_size": 1, "cp_size": 1}  # nothing trains: any layout will do

    def offload_events(self) -> list[tuple[float, str]]:
        return []


def train_backend_class(args: Namespace) -> type:
    """The class `--train-backend` names (the idle one under `--debug-rollout-only`)."""
    if args.debug_rollout_only:
        return IdleBackend
    return load_function(TRAIN_BACKENDS.get(args.train_backend, args.train_backend))
