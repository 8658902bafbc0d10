"""Small HTTP helpers shared by the rollout side: ports, readiness waits and a pooled async JSON client.

One aiohttp session per event loop: a session is bound to the loop that created it, and thousands of
concurrent rollout requests must share one connection pool (the rollout semaphore bounds concurrency,
so the pool itself is unlimited).
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import random
import socket
import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import aiohttp

logger = logging.getLogger(__name__)

_sessions: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, aiohttp.ClientSession] = weakref.WeakKeyDictionary()


# Ports handed out by the OS (bind to port 0) come from the ephemeral range, the same range every outgoing
# connection (HTTP clients, gloo's rank-to-rank sockets) takes its source port from: a port picked there can be
# taken by a connection before its server binds it (seen as EADDRINUSE in TCPStore under parallel tests). So
# ports are picked at random below that range, and above Ray's default worker ports (10002-19999).
_PICK_LOW = 20000
_issued: set[int] = set()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def port_is_free(host: str, port: int) -> bool:
    """Can a listener bind `host:port` right now?"""
    return _bindable(host, port)


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


NODE_ADDRESS_ENV = "SLIME_NODE_ADDRESS"


def node_address() -> str:
    """The address slime's servers and rendezvous bind on this node.

    On a cluster it is the Ray node's address (what the other nodes reach). A run whose Ray cluster the driver
    started itself never leaves this machine: `init_ray` sets $SLIME_NODE_ADDRESS to loopback for every process
    of the run (Ray itself reports the machine's interface address even then). Outside Ray: loopback."""
    if os.environ.get(NODE_ADDRESS_ENV):
        return os.environ[NODE_ADDRESS_ENV]
    import ray

    return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"


def find_free_port(start: int | None = None, host: str = "127.0.0.1") -> int:
    """A port free on `host` now, outside the ephemeral range where possible; or the first free one at or above
    `start`. A port is not handed out twice by one process."""
    if start is not None:
        for port in range(start, 65536):
            if port not in _issued and _bindable(host, port):
                _issued.add(port)
                return port
        raise RuntimeError(f"no free port on {host} at or above {start}")
    high = _ephemeral_low()
    if high - _PICK_LOW >= 1000:
        rng = random.SystemRandom()  # not the seeded global RNG: forked workers must not draw the same ports
        for _ in range(200):
            port = rng.randrange(_PICK_LOW, high)
            if port not in _issued and _bindable(host, port):
                _issued.add(port)
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # a crowded or unusual range: the OS's pick
        s.bind((host, 0))
        port = s.getsockname()[1]
    _issued.add(port)
    return port


def get_session() -> aiohttp.ClientSession:
    """The shared session of the running loop (created on first use)."""
    import aiohttp  # here: processes that only need ports (engine actors, the driver) skip its ~1 s import

    loop = asyncio.get_running_loop()
    session = _sessions.get(loop)
    if session is None or session.closed:
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None)
        )
        _sessions[loop] = session
    return session


@atexit.register
def _close_sessions_at_exit() -> None:
    # Sessions living on a still-running background loop (slime.utils.async_utils) are closed there, so the
    # interpreter does not warn about unclosed connectors on exit.
    for loop, session in list(_sessions.items()):
        if loop.is_running() and not loop.is_closed() and not session.closed:
            try:
                asyncio.run_coroutine_threadsafe(session.close(), loop).result(timeout=5)
            except Exception:  # exiting anyway
                pass


async def close_session() -> None:
    """Close the running loop's shared session (tests, shutdown)."""
    session = _sessions.pop(asyncio.get_running_loop(), None)
    if session is not None and not session.closed:
        await session.close()


async def _request_json(
    method: str,
    url: str,
    payload: Any | None,
    headers: dict[str, str] | None,
    timeout: float | None,
    max_retries: int,
) -> Any:
    # Only connection failures are retried: a 4xx/5xx answer is the server's verdict, and re-sending a
    # /generate that reached the engine would duplicate work.
    import aiohttp

    delay = 0.2
    for attempt in range(max_retries + 1):
        try:
            async with get_session().request(
                method, url, json=payload, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout)
            ) as resp:
                if resp.status >= 400:
                    body = await resp.text()
                    raise RuntimeError(f"{method} {url} -> HTTP {resp.status}: {body[:500]}")
                return await resp.json(content_type=None)
        except (TimeoutError, aiohttp.ClientConnectionError) as e:
            if attempt == max_retries:
                raise RuntimeError(f"{method} {url} failed after {max_retries + 1} attempt(s): {e!r}") from e
            logger.warning("%s %s failed (%r); retry %d/%d", method, url, e, attempt + 1, max_retries)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)
    raise AssertionError("unreachable")


async def post_json(
    url: str,
    payload: Any,
    *,
    headers: dict[str, str] | None = None,
    timeout: float | None = None,
    max_retries: int = 3,
) -> Any:
    """POST `payload` as JSON and return the decoded JSON answer; raise on HTTP errors."""
    return await _request_json("POST", url, payload, headers, timeout, max_retries)


async def get_json(url: str, *, timeout: float | None = 30.0, max_retries: int = 3) -> Any:
    """GET `url` and return the decoded JSON answer; raise on HTTP errors."""
    return await _request_json("GET", url, None, None, timeout, max_retries)
