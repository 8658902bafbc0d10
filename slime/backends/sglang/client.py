"""The one speaker of SGLang's control API: health, scheduling, memory, weight updates, the weight checker.

Every module that controls an inference server (the engine actor, weight sync from the trainer, the rollout's
abort, the weight checker) asks this client, so an endpoint's body and its error handling live in one place.
Bodies follow `python/sglang/srt/managers/io_struct.py` and `python/sglang/srt/entrypoints/http_server.py` of the
release the server reports (`protocol`, `versions.py`: 0.5.14 to 0.5.23); `docs/sglang_contract.md` lists what
slime relies on. The data path (`/generate`) is not
here: it goes through the router (`slime/rollout/generate.py`).

Why `http.client` and not httpx: a weight sync is a chain of small control calls (pause, flush, begin, one per
bucket, end, continue) whose round trips add up against a hand-off measured in milliseconds; on loopback a
kept-alive `http.client` connection answers in ~0.5 ms where an `httpx.Client` call takes ~1.5 ms.
"""

from __future__ import annotations

import http.client
import io
import json
import logging
import socket
import threading
import time
import urllib.parse
import weakref
from collections.abc import Callable
from typing import Any

from slime.backends.sglang.versions import PAUSE_MODES, SGLangProtocol, protocol_for

logger = logging.getLogger(__name__)

ALL_MEMORY_TAGS = None  # `tags: null` releases / resumes weights, KV cache and CUDA graphs at once


class SGLangError(RuntimeError):
    """A server refused a control call (non-200, or `success: false` in the body)."""


# a kept-alive connection the server has closed meanwhile fails on first use with one of these, before the
# server read the request: such a call is sent again, once, on a fresh connection
_STALE = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError)
ERRORS = (OSError, http.client.HTTPException)  # what a call raises when the server cannot be reached or answer
# uvicorn (SGLang's HTTP server) closes a kept-alive connection idle for 5 s by default: a call on it fails and
# goes out again on a fresh one, after the caller waited for its answer (a weight sync's pipelined opening would
# lose the packing it overlaps). A connection idle this long is replaced before it is used.
IDLE_RECONNECT_S = 4.0


class _Stream(io.BufferedReader):
    """One buffered reader over a connection's socket for pipelined answers: `http.client.HTTPResponse` reads
    from `sock.makefile()` and closes it after each answer, which would lose what the buffer read ahead of the
    next answer."""

    def __init__(self, sock: socket.socket) -> None:
        super().__init__(socket.SocketIO(sock, "rb"))

    def makefile(self, *args: Any, **kwargs: Any) -> _Stream:
        return self

    def close(self) -> None:  # an answer is done: keep reading the next one from the same buffer
        pass

    def release(self) -> None:
        super().close()  # the socket stays open (the connection's); only this reader's hold on it goes


class SGLangClient:
    """Control calls to one server (`url` = http://host:port). Thread-safe: each thread keeps its own
    connection (weight sync posts from a thread of its own)."""

    def __init__(self, url: str, timeout: float = 600.0) -> None:
        self.url = url.rstrip("/")
        parsed = urllib.parse.urlsplit(self.url)
        if parsed.scheme != "http" or not parsed.hostname or parsed.port is None:
            raise ValueError(f"expected http://host:port, got {url!r}")
        self._host, self._port, self._prefix = parsed.hostname, parsed.port, parsed.path
        self.timeout = timeout
        self._local = threading.local()
        self._lock = threading.Lock()
        self._open: list[http.client.HTTPConnection] = []
        self._streams: dict[http.client.HTTPConnection, _Stream] = {}  # per connection, its thread's own
        self._unread: dict[http.client.HTTPConnection, int] = {}  # per connection, `send`s not yet read
        self._resent: weakref.WeakSet[http.client.HTTPConnection] = weakref.WeakSet()  # closed before answering
        self._protocol: SGLangProtocol | None = None

    def close(self) -> None:
        with self._lock:
            conns, self._open = self._open, []
        for c in conns:
            stream = self._streams.pop(c, None)
            if stream is not None:
                stream.release()
            c.close()

    def _connection(self) -> tuple[http.client.HTTPConnection, bool]:
        conn = getattr(self._local, "conn", None)
        now = time.monotonic()
        if conn is not None:
            idle = now - self._local.used
            self._local.used = now
            if idle < IDLE_RECONNECT_S or self._unread.get(conn):
                return conn, True
            self._drop(conn)  # the server may have closed it meanwhile
        self._local.used = now
        conn = self._local.conn = http.client.HTTPConnection(self._host, self._port, timeout=self.timeout)
        with self._lock:
            self._open.append(conn)
        return conn, False

    def request(self, method: str, endpoint: str, body: Any = None, timeout: float | None = None) -> tuple[int, bytes]:
        """(status, body bytes) of one call; `body` is sent as JSON (POST). Raises one of `ERRORS` when the server
        cannot be reached or does not answer within `timeout` (the client's default when None)."""
        return self.send([(method, endpoint, body)], timeout)()[0]

    def discard(self) -> None:
        """Close this thread's connection: after a failure between `send` and reading its answers, those
        answers would otherwise be read by the next call."""
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            self._drop(conn)

    def _stream(self, conn: http.client.HTTPConnection) -> _Stream:
        """The connection's reader for pipelined answers, one for all of them: calls sent back to back may be read
        by several `send` readers, and a reader of its own each would lose what one read ahead of the next."""
        stream = self._streams.get(conn)
        if stream is None:  # dropped with its connection (`_drop`), so never one of an earlier socket
            stream = self._streams[conn] = _Stream(conn.sock)
        return stream

    def _drop(self, conn: http.client.HTTPConnection) -> None:
        self._unread.pop(conn, None)
        stream = self._streams.pop(conn, None)
        if stream is not None:
            stream.release()
        conn.close()
        self._local.conn = None
        with self._lock:
            if conn in self._open:
                self._open.remove(conn)

    def __enter__(self) -> SGLangClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, endpoint: str, body: dict[str, Any] | None = None, timeout: float | None = None):
        return self._checked(endpoint, *self.request(method, endpoint, body, timeout))

    def _checked(self, endpoint: str, status: int, content: bytes) -> Any:
        """The answer's JSON (or text); raises `SGLangError` on a non-200 status or `success: false`."""
        try:
            data = json.loads(content) if content else None
        except ValueError:  # several control endpoints answer plain text
            data = content.decode(errors="replace")
        if status != 200 or (isinstance(data, dict) and data.get("success") is False):
            message = data.get("message", data) if isinstance(data, dict) else data
            raise SGLangError(f"{self.url}{endpoint} answered {status}: {str(message)[:300]}")
        return data

    def send(
        self, calls: list[tuple[str, str, Any]], timeout: float | None = None
    ) -> Callable[[], list[tuple[int, bytes]]]:
        """Write every (method, endpoint, JSON body) call at once on this thread's connection and return the
        function that reads their (status, body bytes), in order; make no other call from this thread before it.

        HTTP/1.1 pipelining: the server reads the calls in one go and answers them one after the other, in order
        (aiohttp and uvicorn both do). Why: inside a weight sync, a call that waits for the one before costs a
        wake-up of each process (0.3-1 ms measured, docs/performance.md) for a handler that runs ~0.1 ms, and the
        caller can pack its buckets between writing and reading."""
        requests = []
        for method, endpoint, body in calls:
            data = json.dumps(body if body is not None else {}).encode() if method == "POST" else b""
            head = f"{method} {self._prefix}{endpoint} HTTP/1.1\r\nHost: {self._host}:{self._port}\r\n"
            head += "Accept-Encoding: identity\r\n"
            if method == "POST":
                head += f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n"
            requests.append(head.encode() + b"\r\n" + data)
        wire = b"".join(requests)

        def write() -> tuple[http.client.HTTPConnection, bool]:
            while True:
                conn, reused = self._connection()
                conn.timeout = self.timeout if timeout is None else timeout
                # sent again elsewhere, these calls would overtake the ones still unanswered on this connection
                earlier = self._unread.get(conn, 0)
                try:
                    if conn.sock is None:
                        conn.connect()
                    conn.sock.settimeout(conn.timeout)
                    conn.sock.sendall(wire)
                    self._unread[conn] = earlier + 1
                    return conn, reused
                except BaseException as e:
                    self._drop(conn)
                    if not (reused and not earlier and isinstance(e, _STALE)):
                        raise

        conn, reused = write()

        def read() -> list[tuple[int, bytes]]:
            nonlocal conn, reused
            while True:
                answers: list[tuple[int, bytes]] = []
                try:
                    if conn.sock is None:  # dropped by the reader of a send before this one
                        if conn in self._resent:  # closed before it answered anything: this one is sent again too
                            raise http.client.RemoteDisconnected(f"{self.url}: closed before answering")
                        raise ConnectionAbortedError(f"{self.url}: the connection failed before this answer")
                    stream = self._stream(conn)
                    for method, _, _ in calls:
                        r = http.client.HTTPResponse(stream, method=method)  # type: ignore[arg-type]
                        r.begin()
                        answers.append((r.status, r.read()))
                        if r.will_close and len(answers) < len(calls):
                            raise http.client.RemoteDisconnected(
                                f"{self.url} closed the connection after {len(answers)} of {len(calls)} calls"
                            )
                    self._unread[conn] -= 1
                    self._local.used = time.monotonic()
                    if r.will_close:
                        self._drop(conn)
                    return answers
                except BaseException as e:
                    self._drop(conn)
                    if not (reused and not answers and isinstance(e, _STALE)):
                        raise
                    self._resent.add(conn)
                    conn, reused = write()  # a kept-alive connection closed before it read anything: once more

        return read

    # ---- health and identity ----------------------------------------------------------------------------
    def healthy(self, endpoint: str = "/health_generate", timeout: float = 30.0) -> bool:
        """`/health_generate` runs one token through the model (SGLang's deep check); `/health` only pings."""
        try:
            return self.request("GET", endpoint, timeout=timeout)[0] == 200
        except ERRORS:
            return False

    def server_info(self) -> dict[str, Any]:
        """`/server_info` (every release slime speaks; the older alias `/get_server_info` logs a deprecation on the
        server each time)."""
        return self._call("GET", "/server_info", timeout=30.0)

    @property
    def protocol(self) -> SGLangProtocol:
        """What this server's release speaks, asked once (`/server_info`'s `version`)."""
        if self._protocol is None:
            version = self.server_info().get("version")
            if not version:
                raise SGLangError(f"{self.url}/server_info reports no version: not an SGLang server slime knows")
            self._protocol = protocol_for(str(version))
        return self._protocol

    def weight_version(self) -> str:
        return str(self._call("GET", "/model_info", timeout=30.0).get("weight_version"))

    # ---- scheduling -------------------------------------------------------------------------------------
    def pause_generation(self, mode: str = "abort") -> None:
        """`abort` (SGLang's default) answers in-flight requests as aborted with their tokens so far; `in_place` keeps
        them in the scheduler with their KV cache; `retract` moves them back to the waiting queue."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r}: expected one of {PAUSE_MODES}")
        self._call("POST", "/pause_generation", {"mode": mode})

    def continue_generation(self) -> None:
        self._call("POST", "/continue_generation")

    def flush_cache(self, timeout: float = 60.0) -> None:
        """SGLang refuses to flush (400) while requests run or wait: retry until it is idle or `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            status, content = self.request("POST", "/flush_cache", timeout=timeout)
            if status == 200:
                return
            if time.monotonic() > deadline:
                raise SGLangError(f"{self.url}/flush_cache still refused after {timeout:.0f}s: {content[:200]!r}")
            time.sleep(0.5)

    def abort_all(self) -> None:
        self._call("POST", "/abort_request", {"abort_all": True}, timeout=30.0)

    # ---- memory (colocated offload) ---------------------------------------------------------------------
    def release_memory_occupation(self, tags: list[str] | None = ALL_MEMORY_TAGS) -> None:
        self.flush_cache()  # SGLang refuses to release while its cache holds requests' pages
        self._call("POST", "/release_memory_occupation", {"tags": tags})

    def resume_memory_occupation(self, tags: list[str] | None = ALL_MEMORY_TAGS) -> None:
        self._call("POST", "/resume_memory_occupation", {"tags": tags})

    # ---- weights ----------------------------------------------------------------------------------------
    def begin_weight_update(self) -> None:
        """Open a weight-update session where the release has them (0.5.21+); a no-op before."""
        if self.protocol.weight_update_sessions:
            self._call("POST", "/begin_weight_update", {"selector": "all"})

    def end_weight_update(self) -> None:
        if self.protocol.weight_update_sessions:
            self._call("POST", "/end_weight_update")

    def update_weights_from_tensor(
        self, serialized_named_tensors: list[str], weight_version: str, load_format: str = "flattened_bucket"
    ) -> None:
        self.send_update_weights_from_tensor(serialized_named_tensors, weight_version, load_format)()

    def send_update_weights_from_tensor(
        self, serialized_named_tensors: list[str], weight_version: str, load_format: str = "flattened_bucket"
    ) -> Callable[[], None]:
        """Write the post now (pipelined behind any call not yet answered, `send`); returns the function that
        waits for its answer and raises if the engine refused it."""
        body = {
            "serialized_named_tensors": serialized_named_tensors,
            "load_format": load_format,
            "flush_cache": False,
            "weight_version": weight_version,
        }
        read = self.send([("POST", "/update_weights_from_tensor", body)])
        return lambda: self._checked("/update_weights_from_tensor", *read()[0])

    def update_weights_from_disk(self, model_path: str, weight_version: str | None = None) -> None:
        self._call("POST", "/update_weights_from_disk", {"model_path": model_path, "weight_version": weight_version})

    def init_weights_update_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str
    ) -> None:
        body = {"master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
                "world_size": world_size, "group_name": group_name, "backend": backend}  # fmt: skip
        self._call("POST", "/init_weights_update_group", body)

    def update_weights_from_distributed(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str, weight_version: str
    ) -> None:
        body = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
                "weight_version": weight_version, "load_format": "flattened_bucket", "flush_cache": False}  # fmt: skip
        self._call("POST", "/update_weights_from_distributed", body)

    def destroy_weights_update_group(self, group_name: str) -> None:
        self._call("POST", "/destroy_weights_update_group", {"group_name": group_name})

    def weight_checksums(self, skip_tensor_list: list[str] | None = None) -> dict[str, Any]:
        """`/weights_checker {"action": "checksum"}`: per-rank, per-tensor checksums of the loaded weights, without
        the tensors whose names contain a `skip_tensor_list` entry (left out here where the release ignores it)."""
        body: dict[str, Any] = {"action": "checksum"}
        local_skip = bool(skip_tensor_list) and not self.protocol.checker_skip_list
        if skip_tensor_list and not local_skip:
            body["skip_tensor_list"] = skip_tensor_list
        data = self._call("POST", "/weights_checker", body, timeout=120.0)
        if local_skip:
            for rank in data.get("ranks") or []:
                sums = rank.get("checksums") or {}
                rank["checksums"] = {n: c for n, c in sums.items() if not any(p in n for p in skip_tensor_list)}
        return data


def _session_calls(client: SGLangClient, calls: list[tuple[str, str, Any]]) -> list[tuple[str, str, Any]]:
    """`calls` without the session's begin/end where the release has no update sessions (before 0.5.21)."""
    if client.protocol.weight_update_sessions:
        return calls
    return [c for c in calls if c[1] not in ("/begin_weight_update", "/end_weight_update")]


def start_weight_sync(clients: list[SGLangClient], in_flight: bool = False) -> Callable[[], None]:
    """Open a weight update on every engine: pause generation, flush the cache, and where the release has them
    (0.5.21+, which loads weights only inside `/begin_weight_update` ... `/end_weight_update`) begin the update
    session. The pause uses SGLang's default mode, `abort`: a request still in flight (none in the synchronous
    loop, which syncs between rollouts) comes back aborted with its tokens so far.

    `in_flight` (`--update-weights-in-flight`): the pause is `in_place` (every release 0.5.14-0.5.23 has it,
    io_struct.py `PauseGenerationReqInput`): running requests stay in the scheduler with their KV cache and
    continue under the new weights after `/continue_generation`. No flush then: SGLang refuses it while requests
    are in the running batch, and their cache is what they continue from (KV computed under the old weights,
    as PipelineRL's in-flight updates keep it).

    The three calls go to every engine at once, pipelined (`SGLangClient.send`); this returns the function that
    reads the answers, so the caller packs its first buckets meanwhile. A flush refused because aborted requests
    are still finishing is retried until the engine is idle; no weights are posted before that."""
    pause = ("POST", "/pause_generation", {"mode": "in_place"} if in_flight else {})
    flush = [] if in_flight else [("POST", "/flush_cache", None)]
    calls = [pause, *flush, ("POST", "/begin_weight_update", {"selector": "all"})]
    sent = [(c, _session_calls(c, calls)) for c in clients]
    reads = [(c, own, c.send(own)) for c, own in sent]

    def opened() -> None:
        for c, own, read in reads:
            (paused, paused_body), *rest = read()
            c._checked("/pause_generation", paused, paused_body)
            if flush:
                (flushed, _), *rest = rest
                if flushed != 200:
                    c.flush_cache()
            for (_, endpoint, _), (status, body) in zip(own[1 + len(flush) :], rest, strict=True):
                c._checked(endpoint, status, body)

    return opened


def begin_weight_sync(clients: list[SGLangClient], in_flight: bool = False) -> None:
    """`start_weight_sync`, waiting for the engines to answer."""
    start_weight_sync(clients, in_flight)()


def start_end_weight_sync(clients: list[SGLangClient]) -> Callable[[], None]:
    """Close the update session and resume generation: both calls written to every engine at once, pipelined
    behind any post still being answered (`SGLangClient.send`); returns the function that reads the answers.

    Written behind the last post, they spare the sync one wake-up of each process (~0.5 ms of a ~10 ms sync of a
    2B model, docs/performance.md); the price: when a post is refused once the last one is out, the engines end
    the session and resume on the weights they loaded, and the sync raises (the training job stops there). No second flush: the one at the
    start ran while generation was paused, and nothing fills the cache until it continues (slime v0.3.0 flushes
    once too)."""
    calls = [("POST", "/end_weight_update", {}), ("POST", "/continue_generation", {})]
    sent = [(c, _session_calls(c, calls)) for c in clients]
    reads = [(c, own, c.send(own)) for c, own in sent]

    def closed() -> None:
        for c, own, read in reads:
            for (_, endpoint, _), (status, body) in zip(own, read(), strict=True):
                c._checked(endpoint, status, body)

    return closed


def end_weight_sync(clients: list[SGLangClient]) -> None:
    """`start_end_weight_sync`, waiting for the engines to answer."""
    start_end_weight_sync(clients)()
