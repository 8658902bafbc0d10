"""The gateway's side of SGLang's native `/generate`: token ids in, sampled ids + log-probs out.

Wire shapes as in SGLang 0.5.23 (python/sglang/srt/managers/io_struct.py `GenerateReqInput`: rid, input_ids,
sampling_params, return_logprob; python/sglang/srt/entrypoints/http_server.py `/generate` answers
`{text, output_ids, meta_info}` with `meta_info.output_token_logprobs = [[logprob, id, text|None], ...]` and
`meta_info.finish_reason = {"type": ...}`; `/abort_request` takes `{"rid": ...}`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from dataclasses import dataclass
from typing import Any

import aiohttp

logger = logging.getLogger(__name__)

ROUTING_KEY_HEADER = "X-SMG-Routing-Key"  # sglang-router's consistent-hashing key: one session, one engine
_HOST_PORT = re.compile(r"(?:[A-Za-z][A-Za-z0-9+.-]*://)?(?:\[[0-9A-Fa-f:.]+\]|[\w.-]+):\d{1,5}\S*")


class EngineError(Exception):
    """The engine failed or answered an error. `str(e)` is what the client is told, so it never names the
    engine's address (the gateway may face clients that must not learn the cluster's layout); `detail` is
    the whole story, for the gateway's log. `status` is what the gateway answers: 4xx only for the engine's
    own verdict on the request, 502 otherwise."""

    def __init__(self, message: str, status: int = 502, detail: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.detail = detail or message


def redact_hosts(text: str) -> str:
    """`text` without anything shaped like a host:port or URL (an engine's error may name its own address)."""
    return _HOST_PORT.sub("<engine>", text)


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
        where = f"{self.url}/generate"
        try:
            async with self._http().post(where, json=payload, headers=headers) as resp:
                if resp.status >= 400:
                    text = (await resp.text(errors="replace"))[:300]
                    detail = f"{where} answered HTTP {resp.status}: {text}"
                    if resp.status < 500:
                        why = redact_hosts(_error_message(text))
                        raise EngineError(f"the engine rejected the request: {why}", 400, detail)
                    raise EngineError(f"the engine failed (HTTP {resp.status})", 502, detail)
                out = await resp.json(content_type=None)
        except asyncio.CancelledError:
            # The client went away: free the engine slot now (the closed connection alone may not reach a
            # worker behind a router).
            task = asyncio.get_running_loop().create_task(self.abort(rid))
            self._abort_tasks.add(task)
            task.add_done_callback(self._abort_tasks.discard)
            raise
        except (aiohttp.ClientError, TimeoutError) as e:
            raise EngineError("the engine could not be reached", 502, f"{where}: {e!r}") from e
        except (ValueError, UnicodeDecodeError) as e:  # not JSON
            raise EngineError("the engine answered malformed JSON", 502, f"{where}: {e!r}") from e
        try:
            return _result(out)
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            raise EngineError("the engine's answer has an unexpected shape", 502, f"{where}: {e!r}") from e

    async def context_length(self, timeout_s: float = 5.0) -> int | None:
        """The served model's context length, as SGLang lists it (`/v1/models`: `max_model_len`, the
        tokenizer manager's `model_config.context_len`, python/sglang/srt/entrypoints/http_server.py); None
        when the engine does not say (not reachable yet, or an older server)."""
        try:
            timeout = aiohttp.ClientTimeout(total=timeout_s)
            async with self._http().get(f"{self.url}/v1/models", timeout=timeout) as resp:
                if resp.status != 200:
                    return None
                cards = (await resp.json(content_type=None)).get("data") or []
        except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError) as e:
            logger.info("engine %s did not say its context length: %r", self.url, e)
            return None
        lengths = [c.get("max_model_len") for c in cards if isinstance(c, dict)]
        return next((int(n) for n in lengths if isinstance(n, int) and n > 0), None)

    async def abort(self, rid: str) -> None:
        try:
            async with self._http().post(f"{self.url}/abort_request", json={"rid": rid}) as resp:
                await resp.read()
        except (aiohttp.ClientError, TimeoutError) as e:
            logger.warning("abort of %s failed: %r", rid, e)


def _result(out: Any) -> EngineResult:
    meta = out.get("meta_info") or {}
    items = meta.get("output_token_logprobs") or []
    ids = out.get("output_ids")
    if ids is None:
        ids = [int(it[1]) for it in items]
    if len(items) != len(ids):
        raise ValueError(f"{len(ids)} output ids but {len(items)} log-probs")
    finish = meta.get("finish_reason") or {}
    kind = finish.get("type", "stop") if isinstance(finish, dict) else str(finish)
    return EngineResult([int(i) for i in ids], [float(it[0]) for it in items], kind, meta)


def _error_message(text: str) -> str:
    """The message of an SGLang error answer (`{"error": {"message": ...}}`, or FastAPI's `{"detail": ...}`)."""
    try:
        body = json.loads(text)
    except ValueError:
        return text
    if isinstance(body, dict):
        err = body.get("error")
        msg = err.get("message") if isinstance(err, dict) else body.get("message", body.get("detail"))
        if isinstance(msg, str):
            return msg
    return text
