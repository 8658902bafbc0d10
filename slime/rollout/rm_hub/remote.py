"""`remote_rm`: ask an HTTP reward service for a sample's reward.

Why one shared session per event loop: rollouts score thousands of samples concurrently, and a session per
request would open a TCP connection (and a TIME_WAIT socket) per sample. Transient failures (connection
errors, timeouts, HTTP 5xx/429) are retried with exponential backoff, since a reward server restarting or
autoscaling must not kill a multi-hour run; other 4xx answers are the caller's mistake and fail at once.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from typing import Any

import aiohttp

from slime.utils.types import Sample

logger = logging.getLogger(__name__)

MAX_TRIES = 10
_TIMEOUT = aiohttp.ClientTimeout(total=600, sock_connect=30)
_sessions: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, aiohttp.ClientSession] = weakref.WeakKeyDictionary()


class RemoteRMError(RuntimeError):
    """The reward service refused the request or stayed unreachable through every retry."""


def _session() -> aiohttp.ClientSession:
    loop = asyncio.get_running_loop()
    session = _sessions.get(loop)
    if session is None or session.closed:
        session = aiohttp.ClientSession(timeout=_TIMEOUT, connector=aiohttp.TCPConnector(limit=1024))
        _sessions[loop] = session
    return session


async def close_remote_session() -> None:
    """Close this event loop's shared session (call before the loop ends to avoid 'Unclosed session')."""
    session = _sessions.pop(asyncio.get_running_loop(), None)
    if session is not None and not session.closed:
        await session.close()


def _reward_from_body(body: Any) -> float | dict[str, Any]:
    # A bare number, `{"reward": x}` (x a number or a dict), or any other dict (then `--reward-key` selects).
    if isinstance(body, (int, float)) and not isinstance(body, bool):
        return float(body)
    if isinstance(body, dict):
        if "reward" in body:
            r = body["reward"]
            return r if isinstance(r, dict) else float(r)
        return body
    raise RemoteRMError(f"reward service answered {body!r}; expected a number or a JSON object")


async def post_with_retries(
    url: str, payload: Any, *, what: str, max_tries: int = MAX_TRIES, base_delay: float = 0.5, max_delay: float = 8.0
) -> Any:
    """POST `payload` and return the decoded JSON answer. Transient failures (connection errors, timeouts, HTTP
    5xx/429) are retried with exponential backoff; another 4xx, or the last failure, raises RemoteRMError."""
    last_error: str = ""
    for attempt in range(max_tries):
        try:
            async with _session().post(url, json=payload) as resp:
                if resp.status < 400:
                    return await resp.json(content_type=None)
                text = (await resp.text())[:200]
                if resp.status != 429 and resp.status < 500:
                    raise RemoteRMError(f"{what} {url} answered HTTP {resp.status}: {text}")
                last_error = f"HTTP {resp.status}: {text}"
        except (TimeoutError, aiohttp.ClientError) as e:
            last_error = f"{type(e).__name__}: {e}"
        if attempt + 1 < max_tries:
            delay = min(base_delay * 2**attempt, max_delay)
            logger.warning("%s %s failed (try %d/%d: %s); retrying in %.1fs", what, url, attempt + 1, max_tries,
                           last_error, delay)  # fmt: skip
            await asyncio.sleep(delay)
    raise RemoteRMError(f"{what} {url} failed {max_tries} times; last error: {last_error}")


async def remote_rm(
    args: Any, sample: Sample, *, max_tries: int = MAX_TRIES, base_delay: float = 0.5, max_delay: float = 8.0
) -> float | dict[str, Any]:
    """POST `{"prompt", "response", "label"}` to `args.rm_url` and return the answer's reward."""
    url = args.rm_url
    if not url:
        raise RemoteRMError("rm_type 'remote_rm' needs --rm-url (the reward service's URL)")
    payload = {"prompt": sample.prompt, "response": sample.response, "label": sample.label}
    body = await post_with_retries(
        url, payload, what="reward service", max_tries=max_tries, base_delay=base_delay, max_delay=max_delay
    )
    return _reward_from_body(body)
