"""Disaggregated weight sync: the trainer broadcasts weights to engines over a process group.

Why a process group and not HTTP payloads: when engines sit on their own GPUs the weights must cross devices,
and NCCL broadcast (gloo on CPU) is the fast path SGLang offers for it. Per pipeline stage, the rank with
DP = TP = CP = 0 holds that stage's full HF-named weights; it creates a group `slime-pp_{pp_rank}` with every
GPU of every receiving engine:

    rank 0                       this trainer rank (the broadcast root)
    ranks 1 .. k_0               engine 0's GPUs (its TP ranks: SGLang joins as rank_offset + tp_rank)
    ranks 1+k_0 .. k_0+k_1       engine 1's GPUs, ...            world size = 1 + sum(k_e)

so engines of different sizes share one group. Per bucket, the metadata (names, dtypes, shapes) travels over
HTTP in `/update_weights_from_distributed` and the bytes follow in one `broadcast` of the bucket flattened to
uint8 (`load_format: flattened_bucket`, SGLang's `FlattenedTensorBucket` layout: tensors back to back, one
dtype per bucket so every tensor stays aligned). The HTTP call returns only after the engine received and
loaded the bucket, so it is issued from a thread while this rank broadcasts.

Request bodies follow SGLang 0.5.23 (python/sglang/srt/managers/io_struct.py):
`InitWeightsUpdateGroupReqInput{master_address, master_port, rank_offset, world_size, group_name, backend}`,
`UpdateWeightsFromDistributedReqInput{names, dtypes, shapes, group_name, flush_cache, abort_all_requests,
weight_version, load_format}`, `DestroyWeightsUpdateGroupReqInput{group_name}`; 0.5.23 only loads weights
inside a `/begin_weight_update` … `/end_weight_update` session. The group is created the way SGLang's
`init_custom_process_group` does (TCP rendezvous with this rank as the store's master, a store prefixed with
the group name, then torch's process-group constructor), so both sides meet on the same keys.
"""

from __future__ import annotations

import datetime
import logging
import socket
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from slime.backends.megatron.weight_buckets import buckets_by_dtype, flatten
from slime.backends.sglang.client import SGLangClient, begin_weight_sync, end_weight_sync
from slime.utils.distributed import listen_socket, master_store

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineTarget:
    """One receiving engine: its URL and how many GPUs (group ranks) it occupies."""

    url: str
    num_gpus: int = 1


def rank_offsets(engines: list[EngineTarget]) -> tuple[list[int], int]:
    """(rank offset of each engine, world size): offsets are cumulative GPU counts after the trainer's rank 0."""
    offsets, nxt = [], 1
    for e in engines:
        if e.num_gpus < 1:
            raise ValueError(f"engine {e.url} has {e.num_gpus} GPUs")
        offsets.append(nxt)
        nxt += e.num_gpus
    return offsets, nxt


def group_name(pp_rank: int) -> str:
    return f"slime-pp_{pp_rank}"


def new_weight_update_group(
    backend: str, sock: socket.socket, world_size: int, name: str, timeout_s: float = 600.0
) -> Any:
    """Rank 0 of a standalone process group next to the default one (what SGLang's engines join), its store
    served on `sock` (listening on this node's address).

    torch's public API allows one default group per process; a second, independent world needs the store and
    the group constructor directly, as SGLang's `init_custom_process_group` does.
    """
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

    timeout = datetime.timedelta(seconds=timeout_s)
    store = PrefixStore(name, master_store(sock, world_size, timeout))
    rank, size = 0, world_size
    pg, _ = _new_process_group_helper(size, rank, [], Backend(backend), store, group_name=name, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(size)}  # lets dist.broadcast(group=pg) map ranks
    return pg


def dtype_name(dtype: torch.dtype) -> str:
    """SGLang reads dtypes with `getattr(torch, name)`."""
    return str(dtype).removeprefix("torch.")


def _flat_bytes(bucket: list[tuple[str, torch.Tensor]], device: torch.device) -> torch.Tensor:
    """The bucket as SGLang's receiver reads it: the tensors back to back, as one uint8 buffer on `device`."""
    return flatten(bucket)[0].view(torch.uint8).to(device)


class DistributedWeightSync:
    """The broadcast root of one pipeline stage; keeps its group across syncs while the engines stay the same."""

    def __init__(
        self,
        *,
        pp_rank: int = 0,
        master_address: str = "127.0.0.1",
        backend: str | None = None,
        bucket_bytes: int = 512 * 1024**2,
        timeout_s: float = 600.0,
    ) -> None:
        self.pp_rank = pp_rank
        self.group_name = group_name(pp_rank)
        self.master_address = master_address
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        )
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="weight-sync-http")
        self.clients: dict[str, SGLangClient] = {}
        self.engines: tuple[EngineTarget, ...] = ()
        self.group: Any = None

    def _client(self, url: str) -> SGLangClient:
        if url not in self.clients:
            self.clients[url] = SGLangClient(url, timeout=self.timeout_s)
        return self.clients[url]

    def _post_all(self, engines: Iterable[EngineTarget], call: str, *args: Any) -> list[Future]:
        """`SGLangClient.<call>(*args)` on every engine at once (an engine answers only after the broadcast)."""
        return [self.pool.submit(getattr(self._client(e.url), call), *args) for e in engines]

    def _wait_with(self, work: Any, futures: list[Future]) -> None:
        """Wait for a collective while watching the engines' answers: an engine that fails before joining
        would otherwise leave this rank blocked until the group's timeout."""
        delay = 0.0005
        while not work.is_completed():
            for f in futures:
                if f.done() and f.exception() is not None:
                    self.group = None  # the collective is broken; rebuild the group next time
                    raise RuntimeError(f"weight sync failed on an engine: {f.exception()}")
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        work.wait()

    # ---- group lifecycle ----------------------------------------------------------------------------------
    def _ranks_of(self, engine: EngineTarget) -> EngineTarget:
        """The engine's own word on how many ranks it joins with (its TP size; SGLang joins as rank_offset +
        tp_rank), which wins over the deployment plan's GPU count if they disagree."""
        try:
            tp = int(self._client(engine.url).server_info().get("tp_size") or 0)
        except Exception:  # noqa: BLE001 - an engine without the field: trust the plan
            tp = 0
        if tp and tp != engine.num_gpus:
            logger.warning("engine %s reports tp_size %d, the plan says %d GPUs: using %d", engine.url, tp,
                           engine.num_gpus, tp)  # fmt: skip
            return EngineTarget(engine.url, tp)
        return engine

    def connect(self, engines: list[EngineTarget]) -> dict[str, Any]:
        """(Re)create the group if the engine set changed; returns what was requested (for logs and tests)."""
        engines_t = tuple(self._ranks_of(e) for e in engines)
        if self.group is not None and engines_t == self.engines:
            return {}
        self.disconnect()
        offsets, world_size = rank_offsets(list(engines_t))
        sock = listen_socket(self.master_address)  # held until the store takes it: no one else can bind the port
        port = sock.getsockname()[1]
        futures = [
            self.pool.submit(
                self._client(e.url).init_weights_update_group,
                self.master_address,
                port,
                off,
                world_size,
                self.group_name,
                self.backend,
            )  # fmt: skip
            for e, off in zip(engines_t, offsets, strict=True)
        ]
        try:
            self.group = new_weight_update_group(self.backend, sock, world_size, self.group_name, self.timeout_s)
        finally:
            for f in futures:
                f.result()  # surfaces an engine's refusal (and waits for every join)
        self.engines = engines_t
        logger.info(
            "weight update group %s: world %d, engines %s", self.group_name, world_size,
            [(e.url, e.num_gpus, off) for e, off in zip(engines_t, offsets, strict=True)],
        )  # fmt: skip
        return {"world_size": world_size, "rank_offsets": offsets, "master_port": port}

    def disconnect(self) -> None:
        """Tear the group down on both sides (best effort on engines that may already be gone)."""
        if self.group is None:
            self.engines = ()
            return
        for f in self._post_all(self.engines, "destroy_weights_update_group", self.group_name):
            try:
                f.result()
            except Exception as e:  # noqa: BLE001 - a dead engine has no group left to destroy
                logger.warning("destroy_weights_update_group: %s", e)
        try:
            dist.destroy_process_group(self.group)
        except Exception:  # noqa: BLE001 - a broken group may refuse an orderly shutdown
            logger.warning("destroying %s failed", self.group_name, exc_info=True)
        self.group, self.engines = None, ()

    # ---- one sync -----------------------------------------------------------------------------------------
    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: int) -> dict[str, float]:
        """Broadcast every tensor, bucket by bucket; `connect` first. Engines must be paused and inside a
        weight-update session (`begin_session`)."""
        if self.group is None:
            raise RuntimeError("DistributedWeightSync.send before connect")
        num_bytes = num_buckets = 0
        for bucket in buckets_by_dtype(named_tensors, self.bucket_bytes):
            meta = (
                [n for n, _ in bucket],
                [dtype_name(t.dtype) for _, t in bucket],
                [list(t.shape) for _, t in bucket],
                self.group_name,
                str(weight_version),
            )
            flat = _flat_bytes(bucket, self.device)
            futures = self._post_all(self.engines, "update_weights_from_distributed", *meta)
            work = dist.broadcast(flat, group=self.group, group_src=0, async_op=True)
            self._wait_with(work, futures)
            for f in futures:
                f.result()
            num_bytes += flat.numel()
            num_buckets += 1
        return {"weight_sync/bytes": float(num_bytes), "weight_sync/buckets": float(num_buckets)}

    def close(self) -> None:
        self.disconnect()
        self.pool.shutdown(wait=False)
        for c in self.clients.values():
            c.close()


class DistributedTransport:
    """`--update-weight-mode distributed` for one train rank: every rank exports (a TP collective) and takes part.

    Rank 0 pauses the engines and opens their weight-update session once; each stage's sender (DP = TP = CP = 0)
    then broadcasts its layers over its own group; rank 0 closes the session when every stage is done."""

    def __init__(self, args: Any, node_ip: str) -> None:
        self.args = args
        self.node_ip = node_ip
        self.sender: DistributedWeightSync | None = None

    def sync(self, trainer: Any, engines: list[dict[str, Any]], weight_version: int) -> dict[str, float]:
        targets = [EngineTarget(e["url"], int(e["num_gpus"])) for e in engines]
        clients = [SGLangClient(t.url) for t in targets] if dist.get_rank() == 0 else []
        begin_weight_sync(clients, self.args.update_weights_in_flight)
        dist.barrier()
        named = trainer.export_hf()
        out: dict[str, float] = {}
        if trainer.is_weight_sender():
            if self.sender is None:
                self.sender = DistributedWeightSync(
                    pp_rank=trainer.ps.rank("pp"),
                    master_address=self.node_ip,
                    backend=self.args.distributed_backend,
                    bucket_bytes=self.args.update_weight_buffer_size,
                    timeout_s=60.0 * self.args.distributed_timeout_minutes,
                )
            self.sender.connect(targets)
            t0 = time.perf_counter()  # conversion (the export generator) and broadcast: the sender's part
            out = self.sender.send(named, weight_version)
            out["weight_sync/send_s"] = time.perf_counter() - t0
        else:
            for _ in named:  # take part in the TP gathers only
                pass
        dist.barrier()
        end_weight_sync(clients)
        for c in clients:
            c.close()
        return out
