"""The gateway's side of SGLang's native `/generate`: token ids in, sampled ids + log-probs out.

Wire shapes as in SGLang 0.5.23 (python/sglang/srt/managers/io_struct.py `GenerateReqInput`: rid, input_ids,
sampling_params, return_logprob; python/sglang/srt/entrypoints/http_server.py `/generate` answers
`{text, output_ids, meta_info}` with `meta_info.output_token_logprobs = [[logprob, id, text|None], ...]` and
`meta_info.finish_reason = {"type": ...}`; `/abort_request` takes `{"rid": ...}`).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import aiohttp

logger = logging.getLogger(__name__)

ROUTING_KEY_HEADER = "X-SMG-Routing-Key"  # sglang-router's consistent-hashing key: one session, one engine


class EngineError(Exception):
    """The engine failed or answered an error; `status` is what the gateway returns (4xx only for the engine's
    own verdict on the request, 502 otherwise)."""

    def __init__(self, message: str, status: int = 502) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class EngineResult:
    output_ids: list[int]
    log_probs: list[float]
    finish_reason: str  # stop | length | abort
    meta_info: dict[str, Any]


class EngineClient:
    def __init__(self, url: str, *, timeout_s: float | None = None) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self._session: aiohttp.ClientSession | None = None
        self._abort_tasks: set[asyncio.Task] = set()

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=self.timeout_s)
            )
        return self._session

    async def close(self) -> None:
        if self._abort_tasks:
            await asyncio.gather(*self._abort_tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    async def generate(
        self, input_ids: list[int], sampling_params: dict[str, Any], *, rid: str, routing_key: str | None = None
    ) -> EngineResult:
        payload = {"rid": rid, "input_ids": input_ids, "sampling_params": sampling_params, "return_logprob": True}
        headers = {ROUTING_KEY_HEADER: routing_key} if routing_key else None
        try:
            async with self._http().post(f"{self.url}/generate", json=payload, headers=headers) as resp:
                if resp.status >= 400:
                    text = await resp.text()
                    status = 400 if 400 <= resp.status < 500 else 502
                    raise EngineError(f"engine answered HTTP {resp.status}: {text[:300]}", status)
                out = await resp.json(content_type=None)
        except asyncio.CancelledError:
            # The client went away: free the engine slot now (the closed connection alone may not reach a
            # worker behind a router).
            task = asyncio.get_running_loop().create_task(self.abort(rid))
            self._abort_tasks.add(task)
            task.add_done_callback(self._abort_tasks.discard)
            raise
        except (aiohttp.ClientError, TimeoutError) as e:
            raise EngineError(f"engine request failed: {e!r}") from e
        meta = out.get("meta_info") or {}
        items = meta.get("output_token_logprobs") or []
        ids = out.get("output_ids")
        if ids is None:
            ids = [int(it[1]) for it in items]
        if len(items) != len(ids):
            raise EngineError(f"engine answered {len(ids)} output ids but {len(items)} log-probs")
        finish = meta.get("finish_reason") or {}
        kind = finish.get("type", "stop") if isinstance(finish, dict) else str(finish)
        return EngineResult([int(i) for i in ids], [float(it[0]) for it in items], kind, meta)

    async def abort(self, rid: str) -> None:
        try:
            async with self._http().post(f"{self.url}/abort_request", json={"rid": rid}) as resp:
                await resp.read()
        except (aiohttp.ClientError, TimeoutError) as e:
            logger.warning("abort of %s failed: %r", rid, e)
