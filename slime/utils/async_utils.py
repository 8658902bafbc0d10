"""One background event loop per process, so sync callers (the RolloutManager, Ray actor methods) can drive
async rollout code without each call building and tearing down its own loop (which would orphan the shared
aiohttp session and every semaphore bound to the old loop)."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_thread: threading.Thread | None = None


def get_event_loop() -> asyncio.AbstractEventLoop:
    """The process-wide background loop, started on first use (daemon thread: it never blocks exit)."""
    global _loop, _thread
    with _lock:
        if _loop is None or _loop.is_closed():
            loop = asyncio.new_event_loop()
            ready = threading.Event()

            def _serve() -> None:
                asyncio.set_event_loop(loop)
                loop.call_soon(ready.set)
                loop.run_forever()

            _thread = threading.Thread(target=_serve, name="slime-async-loop", daemon=True)
            _thread.start()
            ready.wait()
            _loop = loop
        return _loop


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run `coro` on the background loop and block until it finishes; its exception propagates."""
    loop = get_event_loop()
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        coro.close()
        raise RuntimeError("slime.utils.async_utils.run() called from the background loop itself; await instead")
    return asyncio.run_coroutine_threadsafe(coro, loop).result()
