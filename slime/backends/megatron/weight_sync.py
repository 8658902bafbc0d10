"""Colocated weight sync through `/update_weights_from_tensor`: the engines read the trainer's tensors in place.

Each engine receives, per bucket, one serialized payload per GPU it spans (SGLang hands entry i to its TP
rank i): entry i comes from the train rank on that same GPU, so a CUDA IPC handle is always opened on the
device (and node) that holds it. On CPU the same pickling moves the bucket to named shared memory (torch's
`file_system` strategy) and only the name travels. The train ranks of one engine gather their payloads to
the engine's first GPU's rank, which posts them; every rank keeps its bucket alive until the engine answered,
because the engine copies out of the shared storage. GPUs of an engine that no train rank occupies (rollout
larger than training) get the first rank's payload.

The session around the buckets (pause, flush, begin ... end, continue) is `slime/backends/sglang/client.py`.
"""

from __future__ import annotations

import base64
import collections
import contextlib
import io
import itertools
import logging
import pickle
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.multiprocessing.reductions  # noqa: F401 - registers tensor reductions with ForkingPickler

from slime.backends.megatron.weight_buckets import (
    Item,
    LiveWeights,
    bucket_nbytes,
    buckets_by_dtype,
    flatten,
    new_buffer,
)
from slime.backends.sglang.client import SGLangClient, SGLangError, start_end_weight_sync, start_weight_sync

logger = logging.getLogger(__name__)


def serialize(obj: Any) -> str:
    """What SGLang's `MultiprocessingSerializer.serialize(obj, output_str=True)` produces."""
    mp.set_sharing_strategy("file_system")
    buf = io.BytesIO()
    ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(obj)
    return base64.b64encode(buf.getvalue()).decode()


@dataclass(frozen=True)
class ColocatedEngine:
    """A receiving engine and the logical GPUs it spans (train rank r sits on logical GPU r when colocated)."""

    url: str
    base_gpu: int
    num_gpus: int

    def ranks(self, world_size: int) -> list[int]:
        """Train ranks on this engine's GPUs; rank 0 stands in when none is (the engine lies past the trainer)."""
        own = [r for r in range(self.base_gpu, self.base_gpu + self.num_gpus) if r < world_size]
        return own or [0]


class TensorWeightSync:
    """One per train rank. Every rank exports and takes part; leaders (an engine's first rank) post."""

    def __init__(self, engines: list[ColocatedEngine] | list[str], bucket_bytes: int, in_flight: bool = False) -> None:
        """`engines` may be plain URLs when one process sends alone (tools, tests): each gets one payload.
        `in_flight`: the engines are paused in place, their requests kept (`start_weight_sync`)."""
        self.in_flight = in_flight
        ready = dist.is_available() and dist.is_initialized()
        self.rank, self.world_size = (dist.get_rank(), dist.get_world_size()) if ready else (0, 1)
        engines = [ColocatedEngine(e, 0, 1) if isinstance(e, str) else e for e in engines]
        self.engines = engines
        self.bucket_bytes = bucket_bytes
        self.groups: dict[ColocatedEngine, Any] = {}
        for e in engines:  # every rank creates every group, in the same order (a collective)
            ranks = e.ranks(self.world_size)
            group = dist.new_group(ranks, backend="gloo") if len(ranks) > 1 else None
            if self.rank in ranks:
                self.groups[e] = group
        self.clients = {e: SGLangClient(e.url) for e in engines if self._leads(e)}
        self.trace: list[tuple[str, float]] | None = None

    def _leads(self, e: ColocatedEngine) -> bool:
        return e.ranks(self.world_size)[0] == self.rank

    def close(self) -> None:
        for c in self.clients.values():
            c.close()

    def sync(self, named_tensors: Iterable[Item], weight_version: int) -> dict[str, float]:
        """Every rank calls this with the same stream of HF-named tensors; returns what the leaders posted.

        Pipelined: the session's opening calls are written first and answered while the first buckets are packed,
        and its closing calls are written behind the last post (`start_end_weight_sync` says what that costs when
        the last post is refused);
        a thread converts and packs the buckets (`_produce`) while this one posts, two posts in flight (the next
        written before the engines answered the one before, `SGLangClient.send`), so the engines' work and the
        HTTP round trips hide the export's. At most one packed bucket waits beside the two in flight and the one
        being packed, so the memory bound stays a few buckets. Kept views (`LiveWeights`) need no conversion and are
        packed here, without a thread (`_live_payloads`): by row gathers where they can be, and where handed over
        (`LiveWeights.hand_over`) read where they lie (no copy, no memory) and posted first.

        `self.trace`, when a list, receives (event, `time.time()`) pairs: the session opened and closed, each
        payload ready and each post's start and end (`bench/gpu_weight_sync.py` lays them beside the engine's
        request log)."""
        clients = list(self.clients.values())
        mark = self.trace.append if self.trace is not None else lambda _event: None
        mark(("start", time.time()))
        t_start = time.perf_counter()
        seconds = {"export": 0.0, "pack": 0.0, "post": 0.0, "wait": 0.0}
        stop = threading.Event()
        producer: threading.Thread | None = None
        num_bytes = num_buckets = 0
        in_flight: collections.deque[tuple[list[Callable[[], None]], Any]] = collections.deque()  # posts unanswered
        closed: Callable[[], None] | None = None  # once the closing calls are out: reads their answers
        try:
            # the session's opening calls are written first and answered while the first buckets are packed
            t0 = time.perf_counter()
            opened = start_weight_sync(clients, self.in_flight)
            session = time.perf_counter() - t0
            mark(("opening sent", time.time()))
            if isinstance(named_tensors, LiveWeights):
                # kept views need no conversion and pack in a few launches, so no thread: the payloads come in a
                # fixed order from this one. The first is made while the session opens, the second while the
                # engines take in the first, each later one once a post has let its bucket go.
                live = self._live_payloads(named_tensors, seconds, mark)
                payloads: Iterator[Any] = itertools.chain([next(live, None)], live)
            else:
                ready: queue.Queue[Any] = queue.Queue(maxsize=1)
                producer = threading.Thread(
                    target=self._produce,
                    args=(named_tensors, ready, stop, seconds, mark),
                    name="weight-sync-pack",
                    daemon=True,
                )
                producer.start()
                payloads = iter(ready.get, None)  # the packer ends with None

            def take() -> Any:
                t0 = time.perf_counter()
                item = next(payloads, None)
                seconds["wait"] += time.perf_counter() - t0
                return item

            t0 = time.perf_counter()
            opened()
            session += time.perf_counter() - t0
            mark(("opened", time.time()))
            # two posts in flight: the next is written before the engines answered this one (pipelined on the same
            # connection), so each engine starts on it as soon as it is done with this one
            while True:
                item = None
                if len(in_flight) < 2 and closed is None:
                    item = take()
                    if item is None:  # the last post is out: closing the session is written behind it
                        t0 = time.perf_counter()
                        closed = start_end_weight_sync(clients)
                        session += time.perf_counter() - t0
                if isinstance(item, BaseException):
                    raise item
                if item is not None:
                    mark((f"post {num_buckets}", time.time()))
                    t0 = time.perf_counter()
                    in_flight.append((self._send(item[1], weight_version), item))
                    seconds["post"] += time.perf_counter() - t0
                    if self.clients:
                        num_bytes += item[0] * len(self.clients)
                    num_buckets += 1
                    if len(in_flight) < 2:
                        continue
                if not in_flight:
                    break
                reads, item = in_flight.popleft()
                t0 = time.perf_counter()
                for read in reads:
                    read()
                self._let_go()
                seconds["post"] += time.perf_counter() - t0
                mark((f"posted {num_buckets - len(in_flight) - 1}", time.time()))
                del reads, item  # the engines have copied it: the bucket's memory may go
            t0 = time.perf_counter()
            assert closed is not None  # the loop ends only once every post is out and answered
            closing, closed = closed, None  # read once, here
            closing()
            session += time.perf_counter() - t0
            mark(("closed", time.time()))
        except BaseException:
            if closed is not None:  # the closing calls are out: the engines end the session and resume whatever
                with contextlib.suppress(Exception):  # came of the posts; read the answers due, in order, to know
                    for reads, _ in in_flight:
                        for read in reads:
                            with contextlib.suppress(SGLangError):
                                read()
                    closed()
            for c in clients:
                c.discard()  # answers may still be due on its connection: the next call opens a fresh one
            raise
        finally:
            stop.set()
            if producer is not None:
                producer.join(timeout=None if sys.exc_info()[0] is None else 60.0)
                if producer.is_alive():  # stuck in a collective whose peer failed too: let the error through
                    logger.warning("weight sync: the packer thread is still running after the sync failed")
        total = time.perf_counter() - t_start
        if clients:
            logger.info("weight version %d: %d buckets, %.1f MiB to %d engine(s) in %.3fs", weight_version,
                        num_buckets, num_bytes / 2**20, len(clients), total)  # fmt: skip
        return {
            "weight_sync/bytes": float(num_bytes),
            "weight_sync/buckets": float(num_buckets),
            "weight_sync/export_s": seconds["export"],  # conversion (and host-to-device copies while asleep)
            "weight_sync/pack_s": seconds["pack"],  # copies into the flat buckets, serialization
            "weight_sync/post_s": seconds["post"],  # the engines' requests (gathers to the leader included)
            "weight_sync/wait_s": seconds["wait"],  # posting waited for the packer: what the pipeline did not hide
            "weight_sync/session_s": session,  # pause, flush, begin ... end, continue
            "weight_sync/total_s": total,
        }

    def _produce(
        self,
        named_tensors: Iterable[Item],
        ready: queue.Queue[Any],
        stop: threading.Event,
        seconds: dict[str, float],
        mark: Callable[[tuple[str, float]], None],
    ) -> None:
        """The packer thread: (bytes, payload, flat tensor) per bucket into `ready`, then None (or the exception
        raised). The sender keeps each flat tensor alive until its post returned: the engines read it in place."""

        def put(item: Any) -> bool:
            mark(("ready", time.time()))
            while not stop.is_set():
                try:
                    ready.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        def send(flat: torch.Tensor, meta: list[Any], nbytes: int, t0: float) -> bool:
            payload = self._payload(flat, meta)
            seconds["pack"] += time.perf_counter() - t0
            return put((nbytes, payload, flat))

        try:
            it = iter(named_tensors)

            def timed() -> Iterator[Item]:
                while True:
                    t0 = time.perf_counter()
                    item = next(it, None)
                    seconds["export"] += time.perf_counter() - t0
                    if item is None:
                        return
                    yield item

            for bucket in buckets_by_dtype(timed(), self.bucket_bytes):
                t0 = time.perf_counter()
                # a new buffer per bucket, never a reused one: torch keeps a block shared over CUDA IPC out of its
                # allocator's reach until the engine has let go of it, whatever the engine's stream is still doing
                flat, meta = flatten(bucket, new_buffer(bucket))
                if not send(flat, meta, bucket_nbytes(bucket), t0):
                    return
                del bucket, flat
            put(None)
        except BaseException as e:  # noqa: BLE001 - handed to the posting thread, which raises it
            put(e)

    def _live_payloads(
        self, live: LiveWeights, seconds: dict[str, float], mark: Callable[[tuple[str, float]], None]
    ) -> Iterator[tuple[int, Any, torch.Tensor]]:
        """(bytes, payload, flat tensor) per bucket of kept views (`LiveWeights.plan`, made once): the storages
        read in place first — a handle to serialize, no copy on this side, so the first post reaches the engines
        as early as it can — then the packed buckets, whose gathers run on the GPU while the engines decode the
        first post."""
        t0 = time.perf_counter()
        in_place, packed = live.plan(self.bucket_bytes)
        seconds["export"] += time.perf_counter() - t0
        for group in in_place:
            t0 = time.perf_counter()
            flat = group.flat()
            payload = self._payload(flat, group.meta)
            seconds["pack"] += time.perf_counter() - t0
            mark(("ready in place", time.time()))
            yield group.nbytes, payload, flat
        for bucket, gather in packed:
            t0 = time.perf_counter()
            flat, meta = gather.pack() if gather is not None else flatten(bucket, new_buffer(bucket))
            mark(("packed", time.time()))
            payload = self._payload(flat, meta)
            seconds["pack"] += time.perf_counter() - t0
            mark(("ready", time.time()))
            yield bucket_nbytes(bucket), payload, flat

    def _payload(self, flat: torch.Tensor, meta: list[Any]) -> str | None:
        """One bucket as SGLang's flattened-bucket payload; None on a rank that posts to no engine."""
        return serialize({"flattened_tensor": flat, "metadata": meta}) if self.groups else None

    def _send(self, payload: str | None, weight_version: int) -> list[Callable[[], None]]:
        """This rank's payload of one bucket to each of its engines (gathered to the engine's leader first, which
        writes the post); returns the functions that wait for the engines' answers (the leader's), after which
        `_let_go` lets every rank of an engine free the bucket."""
        reads: list[Callable[[], None]] = []
        for e, group in self.groups.items():
            ranks = e.ranks(self.world_size)
            gathered: list[Any] = [payload]
            if group is not None:
                gathered = [None] * len(ranks) if self._leads(e) else None  # type: ignore[assignment]
                dist.gather_object(payload, gathered, dst=ranks[0], group=group)
            if self._leads(e):
                entries = gathered + [gathered[0]] * (e.num_gpus - len(gathered))
                reads.append(self.clients[e].send_update_weights_from_tensor(entries, str(weight_version)))
        return reads

    def _let_go(self) -> None:
        for group in self.groups.values():
            if group is not None:
                dist.barrier(group=group)  # the engine has copied every rank's bucket: they may go


class TensorTransport:
    """`--update-weight-mode tensor` for one train rank: a `TensorWeightSync` to the current engines, rebuilt (new
    groups) when the engine set changes (an engine restarted)."""

    def __init__(self, bucket_bytes: int, in_flight: bool = False) -> None:
        self.bucket_bytes = bucket_bytes
        self.in_flight = in_flight  # --update-weights-in-flight
        self.current: TensorWeightSync | None = None

    def sync(self, trainer: Any, engines: list[dict[str, Any]], weight_version: int) -> dict[str, float]:
        targets = [ColocatedEngine(e["url"], e["base_gpu"], e["num_gpus"]) for e in engines]
        if self.current is None or self.current.engines != targets:
            if self.current is not None:
                self.current.close()
            self.current = TensorWeightSync(targets, self.bucket_bytes, self.in_flight)
        return self.current.sync(trainer.weights_for_sync(), weight_version)
