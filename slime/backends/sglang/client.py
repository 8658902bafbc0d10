"""The one speaker of SGLang's control API: health, scheduling, memory, weight updates, the weight checker.

Every module that controls an inference server (the engine actor, weight sync from the trainer, the rollout's
abort, the weight checker) asks this client, so an endpoint's body and its error handling live in one place.
Bodies follow SGLang 0.5.23 (`python/sglang/srt/managers/io_struct.py`, `python/sglang/srt/entrypoints/
http_server.py`); `docs/sglang_contract.md` lists what slime relies on. The data path (`/generate`) is not
here: it goes through the router (`slime/rollout/generate.py`).

Why `http.client` and not httpx: a weight sync is a chain of small control calls (pause, flush, begin, one per
bucket, end, continue) whose round trips add up against a hand-off measured in milliseconds; on loopback a
kept-alive `http.client` connection answers in ~0.5 ms where an `httpx.Client` call takes ~1.5 ms.
"""

from __future__ import annotations

import http.client
import json
import logging
import threading
import time
import urllib.parse
from typing import Any

logger = logging.getLogger(__name__)

ALL_MEMORY_TAGS = None  # `tags: null` releases / resumes weights, KV cache and CUDA graphs at once


class SGLangError(RuntimeError):
    """A server refused a control call (non-200, or `success: false` in the body)."""


# a kept-alive connection the server has closed meanwhile fails on first use with one of these, before the
# server read the request: such a call is sent again, once, on a fresh connection
_STALE = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError)
ERRORS = (OSError, http.client.HTTPException)  # what a call raises when the server cannot be reached or answer


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

    def close(self) -> None:
        with self._lock:
            conns, self._open = self._open, []
        for c in conns:
            c.close()

    def _connection(self) -> tuple[http.client.HTTPConnection, bool]:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            return conn, True
        conn = self._local.conn = http.client.HTTPConnection(self._host, self._port, timeout=self.timeout)
        with self._lock:
            self._open.append(conn)
        return conn, False

    def request(self, method: str, endpoint: str, body: Any = None, timeout: float | None = None) -> tuple[int, bytes]:
        """(status, body bytes) of one call; `body` is sent as JSON (POST). Raises one of `ERRORS` when the server
        cannot be reached or does not answer within `timeout` (the client's default when None)."""
        data = json.dumps(body if body is not None else {}).encode() if method == "POST" else None
        headers = {"Content-Type": "application/json"} if data is not None else {}
        while True:
            conn, reused = self._connection()
            conn.timeout = self.timeout if timeout is None else timeout
            if conn.sock is not None:
                conn.sock.settimeout(conn.timeout)
            try:
                conn.request(method, self._prefix + endpoint, body=data, headers=headers)
                r = conn.getresponse()
                payload = r.read()
                if r.will_close:
                    self._drop(conn)
                return r.status, payload
            except BaseException as e:
                self._drop(conn)
                if not (reused and isinstance(e, _STALE)):
                    raise

    def _drop(self, conn: http.client.HTTPConnection) -> None:
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
        status, content = self.request(method, endpoint, body, timeout)
        try:
            data = json.loads(content) if content else None
        except ValueError:  # several control endpoints answer plain text
            data = content.decode(errors="replace")
        if status != 200 or (isinstance(data, dict) and data.get("success") is False):
            message = data.get("message", data) if isinstance(data, dict) else data
            raise SGLangError(f"{self.url}{endpoint} answered {status}: {str(message)[:300]}")
        return data

    # ---- health and identity ----------------------------------------------------------------------------
    def healthy(self, endpoint: str = "/health_generate", timeout: float = 30.0) -> bool:
        """`/health_generate` runs one token through the model (SGLang's deep check); `/health` only pings."""
        try:
            return self.request("GET", endpoint, timeout=timeout)[0] == 200
        except ERRORS:
            return False

    def server_info(self) -> dict[str, Any]:
        return self._call("GET", "/get_server_info", timeout=30.0)

    def weight_version(self) -> str:
        return str(self._call("GET", "/model_info", timeout=30.0).get("weight_version"))

    # ---- scheduling -------------------------------------------------------------------------------------
    def pause_generation(self) -> None:
        self._call("POST", "/pause_generation")

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
        self._call("POST", "/begin_weight_update", {"selector": "all"})

    def end_weight_update(self) -> None:
        self._call("POST", "/end_weight_update")

    def update_weights_from_tensor(
        self, serialized_named_tensors: list[str], weight_version: str, load_format: str = "flattened_bucket"
    ) -> None:
        body = {
            "serialized_named_tensors": serialized_named_tensors,
            "load_format": load_format,
            "flush_cache": False,
            "weight_version": weight_version,
        }
        self._call("POST", "/update_weights_from_tensor", body)

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
        """`/weights_checker {"action": "checksum"}`: per-rank, per-tensor checksums of the loaded weights."""
        body: dict[str, Any] = {"action": "checksum"}
        if skip_tensor_list:
            body["skip_tensor_list"] = skip_tensor_list
        return self._call("POST", "/weights_checker", body, timeout=120.0)


def begin_weight_sync(clients: list[SGLangClient]) -> None:
    """Open a weight update on every engine: pause generation, flush the cache, begin the update session
    (SGLang 0.5.23 loads weights only inside `/begin_weight_update` ... `/end_weight_update`). The pause uses
    SGLang's default mode, `abort`: a request still in flight (none in the synchronous loop, which syncs
    between rollouts) comes back aborted with its tokens so far."""
    for c in clients:
        c.pause_generation()
    for c in clients:
        c.flush_cache()
        c.begin_weight_update()


def end_weight_sync(clients: list[SGLangClient]) -> None:
    """Close the update session and resume generation. No second flush: the one in `begin_weight_sync` ran while
    generation was paused, and nothing fills the cache until it continues (slime v0.3.0 flushes once too)."""
    for c in clients:
        c.end_weight_update()
        c.continue_generation()
