"""One fake engine served from several node processes, as SGLang serves an engine larger than a node.

Why: SGLang 0.5.23 starts one server process per node with ``--nnodes N --node-rank K --dist-init-addr HOST:PORT``
(python/sglang/srt/server_args.py). Node rank 0 serves HTTP; the others serve nothing and only join rank 0's
torch.distributed rendezvous at the dist-init address, so the engine is not up until every node has joined, and
it dies with rank 0. slime's launcher, health checks and restarts must handle exactly that process shape, so the
fake reproduces it without the model work:

- node rank 0 listens on the dist-init address (that host only) and counts the other ranks in; its HTTP server
  answers /health and /health_generate 503 while a rank is missing (the whole engine waits on every node);
- node rank K >= 1 opens no listening socket: it connects to the dist-init address, retrying until rank 0 is up
  (for ``--dist-timeout`` seconds), says who it is, then holds the connection; it exits when rank 0 goes away
  (the connection ends) or on SIGTERM. Rank 0 accepts before its model has loaded, so a hello may wait: a rank
  that got no answer in ``HELLO_TIMEOUT_S`` asks again on a new connection (within the same deadline), and rank 0
  lets a repeated hello replace the rank's earlier connection.

Wire format (one JSON line each way): ``{"node_rank": K, "nnodes": N}`` then ``{"ok": true}`` or
``{"ok": false, "error": "..."}``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import time

logger = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 10.0
RETRY_INTERVAL_S = 0.2


def parse_dist_init_addr(addr: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[IPV6]:PORT`` -> (host, port); ValueError with the reason otherwise."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected HOST:PORT, got {addr!r}")
    return host.removeprefix("[").removesuffix("]"), int(port)


class NodeRendezvous:
    """Node rank 0's side: which of the other node ranks are connected right now."""

    def __init__(self, host: str, port: int, nnodes: int) -> None:
        self.host, self.port, self.nnodes = host, port, nnodes
        self._peers: dict[int, asyncio.StreamWriter] = {}
        self.all_joined = asyncio.Event()
        self._server: asyncio.Server | None = None
        # the connections' handler tasks: closing cancels them, so none is left pending for the garbage
        # collector to finish after the loop has gone (its `writer.close()` would then raise, unraisably)
        self._handlers: set[asyncio.Task] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve_peer, host=self.host, port=self.port)

    def missing(self) -> list[int]:
        return [k for k in range(1, self.nnodes) if k not in self._peers]

    async def _serve_peer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        rank = None
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
        try:
            hello = json.loads(await asyncio.wait_for(reader.readline(), HELLO_TIMEOUT_S))
            rank, nnodes = hello["node_rank"], hello["nnodes"]
            error = self._refusal(rank, nnodes)
            writer.write(json.dumps({"ok": error is None, "error": error}).encode() + b"\n")
            await writer.drain()
            if error is not None:
                logger.error("refused a node: %s", error)
                rank = None
                return
            earlier = self._peers.get(rank)
            if earlier is not None:  # the node asked again (its first hello waited too long): this one counts
                logger.warning("node rank %d joined again; its earlier connection is dropped", rank)
                earlier.close()
            self._peers[rank] = writer
            logger.info("node rank %d joined (%d of %d)", rank, len(self._peers) + 1, self.nnodes)
            if not self.missing():
                self.all_joined.set()
            await reader.read()  # until the node goes away: nothing more is sent
            if self._peers.get(rank) is writer:
                logger.error("node rank %d left; the engine is unhealthy until it rejoins", rank)
        except (OSError, ValueError, KeyError, TypeError, TimeoutError) as e:
            logger.error("node connection failed: %r", e)
        finally:
            if rank is not None and self._peers.get(rank) is writer:
                del self._peers[rank]
                self.all_joined.clear()
            writer.close()
            self._handlers.discard(task)

    def _refusal(self, rank: object, nnodes: object) -> str | None:
        if nnodes != self.nnodes:
            return f"node says --nnodes {nnodes}, node rank 0 has --nnodes {self.nnodes}"
        if not isinstance(rank, int) or not 1 <= rank < self.nnodes:
            return f"node rank {rank!r} is not in [1, {self.nnodes})"
        return None

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for w in list(self._peers.values()):
            w.close()
        handlers = [t for t in self._handlers if t is not asyncio.current_task()]
        for t in handlers:
            t.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()


async def run_follower(dist_init_addr: str, node_rank: int, nnodes: int, timeout_s: float) -> int:
    """Node rank >= 1: join node rank 0 and live as long as it does. Returns the exit code (0: SIGTERM)."""
    host, port = parse_dist_init_addr(dist_init_addr)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except OSError as e:
            if time.monotonic() >= deadline:
                logger.error("node rank %d: node rank 0 not reachable at %s within %.0fs (%s)",
                             node_rank, dist_init_addr, timeout_s, e)  # fmt: skip
                return 1
            await asyncio.sleep(RETRY_INTERVAL_S)
            continue
        writer.write(json.dumps({"node_rank": node_rank, "nnodes": nnodes}).encode() + b"\n")
        await writer.drain()
        try:
            reply = json.loads(await asyncio.wait_for(reader.readline(), HELLO_TIMEOUT_S) or b"{}")
            break
        except TimeoutError:
            # node rank 0 accepts before its model is loaded and answers once its loop is free again: a busy
            # machine can take longer than one hello's wait, so ask again until the join deadline
            writer.close()
            if time.monotonic() >= deadline:
                logger.error("node rank %d: no answer from node rank 0 at %s within %.0fs", node_rank,
                             dist_init_addr, timeout_s)  # fmt: skip
                return 1
            logger.warning("node rank %d: node rank 0 at %s has not answered yet; asking again", node_rank,
                           dist_init_addr)  # fmt: skip
        except ValueError as e:
            logger.error("node rank %d: no answer from node rank 0 at %s: %r", node_rank, dist_init_addr, e)
            return 1
    if not reply.get("ok"):
        logger.error("node rank %d: node rank 0 refused to join: %s", node_rank, reply.get("error"))
        return 1
    print(f"fake_sglang node {node_rank}/{nnodes} joined {dist_init_addr}", flush=True)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    gone = asyncio.create_task(reader.read())
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait([gone, stopped], return_when=asyncio.FIRST_COMPLETED)
    for t in (gone, stopped):
        t.cancel()
    writer.close()
    if stop.is_set():
        return 0
    logger.error("node rank %d: node rank 0 at %s went away; exiting", node_rank, dist_init_addr)
    return 1
