"""Ray start-up and the single placement group that every train actor and engine lives in.

On machines without GPUs Ray's resources are logical: the driver starts Ray with `num_gpus` = the placement
group's size and actors request the same fractional GPUs as on GPU hosts (train actor 0.4, engine 0.2), so a
2-core laptop hosts a whole "8-GPU" topology. Bundles are ordered by node address, then GPU id, so logical
GPU k of a multi-node run is the same on every run of the same cluster.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import socket
from argparse import Namespace
from collections.abc import Iterator
from dataclasses import dataclass

import ray
import ray.exceptions
from ray.util.placement_group import PlacementGroup, placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from slime.utils.console import pythonwarnings
from slime.utils.cuda import cuda_available
from slime.utils.errors import SlimeArgError
from slime.utils.http_utils import NODE_ADDRESS_ENV

logger = logging.getLogger(__name__)

# A single-node Ray stays on loopback (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0), no usage stats, no auth token file.
RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
# Ray must not narrow CUDA_VISIBLE_DEVICES per actor: engines address GPUs by base_gpu_id, as in slime.
ACTOR_ENV = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1", "NCCL_CUMEM_ENABLE": "0"}
BUNDLE_CPU = 0.1


def placement_group_size(args: Namespace) -> tuple[int, int]:
    """(bundles, rollout offset): colocated runs need the larger of the train and rollout GPU counts, others the
    sum (rollout GPUs after the train ones); external engines need only the train GPUs."""
    actor_gpus = args.actor_num_nodes * args.actor_num_gpus_per_node
    if args.debug_train_only:
        return actor_gpus, 0
    if args.debug_rollout_only:
        return args.rollout_num_gpus, 0
    if args.colocate:
        return max(actor_gpus, args.rollout_num_gpus), 0
    if args.rollout_external:
        return actor_gpus, actor_gpus
    return actor_gpus + args.rollout_num_gpus, actor_gpus


def _ray_level(args: Namespace) -> int:
    return logging.DEBUG if args.log_level == "DEBUG" else logging.WARNING  # Ray's own start-up chatter


def init_ray(args: Namespace) -> None:
    """Start (or join) Ray. Workers get the driver's cwd on PYTHONPATH so `--*-path` hooks of the project import."""
    for k, v in RAY_ENV.items():
        os.environ.setdefault(k, v)
    if ray.is_initialized():
        return
    python_path = os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p)
    env = {**RAY_ENV, **ACTOR_ENV, "PYTHONPATH": python_path, "PYTHONWARNINGS": pythonwarnings()}
    if args.ray_address:
        os.environ.pop(NODE_ADDRESS_ENV, None)  # every node binds its own address
        ray.init(
            address=args.ray_address, runtime_env={"env_vars": env}, log_to_driver=True, logging_level=_ray_level(args)
        )
        return
    # A cluster of this machine alone: slime's servers bind loopback (slime.utils.http_utils.node_address).
    os.environ[NODE_ADDRESS_ENV] = env[NODE_ADDRESS_ENV] = "127.0.0.1"
    # Ray pre-starts one idle worker per CPU for the first driver; slime's actors ask for their own bundles (and
    # some for their own runtime env), so those workers sit unused (~1 CPU-s each to start) while the run's own
    # processes start.
    os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
    num_bundles, _ = placement_group_size(args)
    has_gpu = cuda_available()
    global _logical_gpus
    _logical_gpus = not has_gpu
    # The workers get `env` as the environment the cluster's processes inherit from this one, not as a job
    # runtime_env: with a runtime_env Ray starts every worker through setup_worker.py (a second interpreter that
    # imports Ray, then execs the worker) after a round trip to its runtime-env agent, ~0.5 CPU-s and ~0.4 s
    # more per actor. A joined cluster (above) keeps the runtime_env: its nodes were not started from here.
    with _environ(env):
        for attempt in range(2):
            try:
                ray.init(
                    address="local",  # a new cluster even if `ray start` left one here (never joined by accident)
                    num_cpus=max(os.cpu_count() or 1, 2) + 2,
                    num_gpus=None if has_gpu else max(num_bundles, 1),
                    include_dashboard=False,
                    object_store_memory=256 * 1024**2,
                    logging_level=_ray_level(args),
                    log_to_driver=True,
                )
                return
            except Exception as e:  # noqa: BLE001 - Ray raises a bare Exception for this one
                # Ray gives its raylet 30 s (hard-coded) to register; a loaded laptop can miss that once
                if attempt or "timed out during startup" not in str(e):
                    raise
                logger.warning("Ray's node did not come up in time (%s); starting it once more", e)
                ray.shutdown()


@contextlib.contextmanager
def _environ(env: dict[str, str]) -> Iterator[None]:
    """`env` over this process's environment while inside (what the processes started inside inherit), then the
    environment as it was: the driver itself keeps its own."""
    before = dict(os.environ)
    os.environ.update(env)
    try:
        yield
    finally:
        for k in env:
            if k in before:
                os.environ[k] = before[k]
            else:
                os.environ.pop(k, None)


# True once init_ray started a cluster of this machine alone with logical GPUs (no CUDA here): then every bundle is
# on this node and its GPU id is a name only, so create_placement_group needs no probe actors to learn them.
_logical_gpus = False


@ray.remote(num_cpus=0)
class _InfoActor:
    def info(self) -> tuple[str, int]:
        gpu_ids = ray.get_gpu_ids()
        return ray.util.get_node_ip_address(), int(gpu_ids[0]) if gpu_ids else 0


def _ip_key(ip: str) -> tuple[int, ...]:
    try:
        return tuple(ipaddress.ip_address(ip).packed)
    except ValueError:
        try:
            return tuple(ipaddress.ip_address(socket.gethostbyname(ip)).packed)
        except (OSError, ValueError):
            return tuple(ord(c) for c in ip)


@dataclass
class Placement:
    """One PG; `bundle_indices[k]` is the bundle of logical GPU k (sorted by node IP, then GPU id)."""

    pg: PlacementGroup
    bundle_indices: list[int]
    gpu_ids: list[int]
    rollout_offset: int

    def strategy(self, logical_gpu: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(
            placement_group=self.pg, placement_group_bundle_index=self.bundle_indices[logical_gpu]
        )


def check_cluster_resources(num_bundles: int) -> None:
    """Fail at once, in one line, when the cluster cannot hold the placement group (instead of waiting on it)."""
    total = ray.cluster_resources()
    gpus = int(total.get("GPU", 0))
    if gpus < num_bundles:
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        per_node = ", ".join(f"{n['NodeManagerAddress']}: {int(n['Resources'].get('GPU', 0))}" for n in nodes)
        raise SlimeArgError(
            f"this run needs {num_bundles} GPUs (placement group of train + rollout GPUs) but the Ray cluster has "
            f"{gpus} ({per_node}); lower --actor-num-gpus-per-node / --rollout-num-gpus or add nodes"
        )
    if total.get("CPU", 0) < num_bundles * BUNDLE_CPU:
        raise SlimeArgError(
            f"this run needs {num_bundles * BUNDLE_CPU:.1f} CPUs for its bundles; the cluster has less"
        )


def create_placement_group(args: Namespace, timeout: float = 120.0) -> Placement:
    num_bundles, rollout_offset = placement_group_size(args)
    if num_bundles == 0:
        raise SlimeArgError("the run needs no GPUs at all; nothing to place")
    check_cluster_resources(num_bundles)
    pg = placement_group([{"GPU": 1, "CPU": BUNDLE_CPU} for _ in range(num_bundles)], strategy="PACK")
    try:
        ray.get(pg.ready(), timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        raise SlimeArgError(
            f"the placement group of {num_bundles} GPUs was not granted within {timeout:.0f}s: the cluster has the "
            "GPUs, but other jobs hold them"
        ) from None
    if _logical_gpus:  # one node, logical GPUs: logical GPU k is bundle k (a probe actor per bundle costs a process)
        logger.info("placement group: %d bundles, rollout offset %d", num_bundles, rollout_offset)
        return Placement(pg, list(range(num_bundles)), list(range(num_bundles)), rollout_offset)
    infos = []
    for i in range(num_bundles):
        actor = _InfoActor.options(
            num_gpus=0.01,
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=i),
        ).remote()
        infos.append((actor, i))
    located = [(ray.get(a.info.remote()), i) for a, i in infos]
    for a, _ in infos:
        ray.kill(a)
    located.sort(key=lambda x: (_ip_key(x[0][0]), x[0][1]))
    logger.info("placement group: %d bundles, rollout offset %d", num_bundles, rollout_offset)
    return Placement(
        pg=pg,
        bundle_indices=[i for _, i in located],
        gpu_ids=[info[1] for info, _ in located],
        rollout_offset=rollout_offset,
    )
