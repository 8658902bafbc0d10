"""Prefill/decode disaggregation for the fake engine, as the real router drives it.

What sglang-router 0.3.2 does in PD mode (observed on loopback, see tests/integration/test_pd_router.py): it
picks one prefill and one decode worker, adds `bootstrap_host` (the prefill's host), `bootstrap_port` (the
port the prefill was registered with) and a random `bootstrap_room` to the body, sends the same body to both
at once and answers with the decode's response. Real SGLang then moves the KV cache from prefill to decode
through the prefill's bootstrap server (python/sglang/srt/disaggregation/{prefill,decode}.py).

The fake mirrors the handshake, not the KV: a prefill engine serves `GET /kv/{room}` on its bootstrap port
and publishes each room's prompt there; a decode engine fetches the room from the address in the request,
checks the prompt is the one it was asked to continue, and only then generates. No prefill within the
timeout is a loud failure (HTTP 500 and an ERROR log line), never a silent regular generation.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from typing import Any

import aiohttp
from aiohttp import web

logger = logging.getLogger(__name__)


def prompt_digest(item: dict[str, Any]) -> str:
    key = repr(item.get("input_ids")) if "input_ids" in item else repr(item.get("text"))
    return hashlib.sha256(key.encode()).hexdigest()[:16]


class PrefillRooms:
    """What a prefill engine has prefilled, keyed by bootstrap_room; each room is handed to one decode only."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.rooms: dict[int, dict[str, Any]] = {}

    def publish(self, room: int, item: dict[str, Any]) -> None:
        self.rooms[int(room)] = {"room": int(room), "prompt_digest": prompt_digest(item), "prefill_url": self.url}

    def app(self) -> web.Application:
        async def kv(request: web.Request) -> web.Response:
            rec = self.rooms.pop(int(request.match_info["room"]), None)
            if rec is None:
                return web.json_response({"error": "room not prefilled (yet)"}, status=404)
            return web.json_response(rec)

        app = web.Application()
        app.router.add_get("/kv/{room}", kv)
        return app


class PDError(Exception):
    """A PD handshake failure: the decode must not generate."""


async def await_prefill(item: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """Decode side: wait until the prefill named in `item` has published the room; return its record."""
    missing = [k for k in ("bootstrap_host", "bootstrap_port", "bootstrap_room") if item.get(k) is None]
    if missing:
        raise PDError(f"decode engine got a request without {', '.join(missing)} (not dispatched by a PD router)")
    url = f"http://{item['bootstrap_host']}:{item['bootstrap_port']}/kv/{int(item['bootstrap_room'])}"
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s:
        while time.monotonic() < deadline:
            try:
                async with s.get(url) as r:
                    if r.status == 200:
                        rec = await r.json()
                        if rec["prompt_digest"] != prompt_digest(item):
                            raise PDError(f"bootstrap_room {item['bootstrap_room']}: prefill holds another prompt")
                        return rec
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.02)
    raise PDError(f"no prefill arrived for bootstrap_room {item['bootstrap_room']} at {url} within {timeout_s:.0f}s")
