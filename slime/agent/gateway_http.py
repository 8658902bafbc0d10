"""The gateway's HTTP side: routes, credentials, admission, request bodies, errors and the admin API.

Routes match on the path *suffix*, so any base-URL prefix a client adds (`/v1`, `/api/v1`, none) works. Client
mistakes get 4xx and never 5xx, because Claude Code retries 5xx for over a minute; error bodies take the shape
of the API asked (`slime.agent.api.error_body`) and never name the engine's address.

Credentials: `Authorization: Bearer <api_key>` or `x-api-key: <api_key>` (the real clients differ), or the key
as path prefix `/s/<api_key>/...` (the `base_url` the admin API returns, for clients that cannot set a key), or
`/sessions/<session_id>/...` together with the key in a header. A key is never logged: paths are masked before
they reach a log line.

No client can stall the gateway for the others. In order, an API request is: authenticated before its body is
read (a stranger's body is never read); admitted (at most `max_session_requests` of one session in flight,
429 beyond); read within `body_timeout_s` (408: a `Content-Length` larger than what is sent is not waited on)
and within `max_body_bytes` (413); prepared on the loop only when that is cheap, else in a prepare worker
(`slime.agent.requests`; an idle-class one for a huge body, `slime.agent.prepare_pool`); held to the model's context (400, as SGLang answers).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import re
import time
from collections.abc import Iterator
from typing import Any, Protocol

from aiohttp import web

from slime.agent import anthropic_api, openai_api
from slime.agent.api import (
    ADMIN,
    ANTHROPIC,
    OPENAI,
    ApiRequest,
    Handler,
    TurnRunner,
    error_body,
    error_response,
    parse_json_body,
    public_error,
    sampling_defaults,
    send,
    sse_of,
)
from slime.agent.context_limit import ContextLimit
from slime.agent.engine_client import EngineError
from slime.agent.messages import BadRequest
from slime.agent.prepare_pool import HUGE_BODY_BYTES, PreparePool
from slime.agent.prompts import PromptBuilder
from slime.agent.requests import cheap_body, cheap_shape, measure, translate
from slime.agent.session import Session
from slime.agent.stores import SessionStore, StoreError, id_shaped
from slime.agent.trajectory import TokenSegment, segment_to_json

logger = logging.getLogger(__name__)


class HttpGateway(TurnRunner, Protocol):
    """What the HTTP side reads of `slime.agent.gateway.Gateway` (which builds its app from here)."""

    store: SessionStore
    builder: PromptBuilder
    limit: ContextLimit
    pool: PreparePool | None
    huge_pool: PreparePool | None
    admin_token: str | None
    request_log: str | None
    max_body_bytes: int
    body_timeout_s: float
    max_session_requests: int
    active: dict[str, int]

    async def open_session(
        self, sampling_defaults: dict[str, Any] | None, max_context_tokens: int, metadata: dict[str, Any] | None
    ) -> dict[str, str]: ...

    async def finish_session(self, session_id: str) -> list[TokenSegment]: ...


_KEY_PREFIX = re.compile(r"^/s/([^/]+)(/.*)?$")
_SID_PREFIX = re.compile(r"^/sessions/([^/]+)(/.*)?$")
ROUTES: list[tuple[str, Handler]] = [
    ("/chat/completions", openai_api.chat_completions),
    ("/responses", openai_api.responses),
    ("/messages/count_tokens", anthropic_api.count_tokens),
    ("/messages", anthropic_api.messages),
]


def api_of(path: str) -> str:
    """Which API a path belongs to, for the shape of its error answers."""
    if path.startswith("/admin/"):
        return ADMIN
    return ANTHROPIC if path.endswith(("/messages", "/messages/count_tokens")) else OPENAI


def masked(path: str) -> str:
    """The path with a key prefix (`/s/<api_key>/...`) masked: what may stand in a log line or an answer."""
    return _KEY_PREFIX.sub(lambda m: "/s/***" + (m.group(2) or ""), path)


def same_secret(given: str | None, expected: str | None) -> bool:
    """Constant-time comparison (a credential check must not leak how much of a guess was right)."""
    if not given or not expected:
        return False
    return hmac.compare_digest(given.encode("utf-8", "surrogatepass"), expected.encode("utf-8", "surrogatepass"))


def build_app(gw: HttpGateway) -> web.Application:
    app = web.Application(client_max_size=gw.max_body_bytes, middlewares=[_errors_of(gw)])
    app.router.add_post("/admin/sessions", lambda r: _admin_create(gw, r))
    app.router.add_get("/admin/sessions/{sid}", lambda r: _admin_get(gw, r))
    app.router.add_post("/admin/sessions/{sid}/finish", lambda r: _admin_finish(gw, r))
    app.router.add_route("*", "/{tail:.*}", lambda r: _dispatch(gw, r))
    return app


def _errors_of(gw: HttpGateway) -> Any:
    @web.middleware
    async def errors(request: web.Request, handler: Any) -> web.StreamResponse:
        """Every error becomes an answer in the API's own shape: in-band once an event stream started."""
        try:
            return await handler(request)
        except web.HTTPException as e:  # aiohttp's own: 413 from reading the body, 405, ...
            if e.status < 400:
                raise
            status = e.status
            message = f"request body over {gw.max_body_bytes} bytes" if status == 413 else e.reason
        except ConnectionResetError:  # the client went away mid-answer: nobody to tell
            logger.debug("client of %s went away", masked(request.path))
            stream = sse_of(request)  # (a response is a mapping: an empty one is falsy)
            return stream if stream is not None else web.Response(status=499)
        except Exception as e:
            status, message = public_error(e)
            if isinstance(e, (EngineError, StoreError)):
                logger.warning("%s on %s: %s", type(e).__name__, masked(request.path), getattr(e, "detail", e))
            elif status >= 500:
                logger.exception("unexpected error on %s %s", request.method, masked(request.path))
        api = api_of(request.path)
        stream = sse_of(request)
        if stream is None:
            return error_response(api, status, message)
        with contextlib.suppress(ConnectionError, RuntimeError):
            await send(stream, error_body(api, status, message), event="error")
            await stream.write_eof()
        return stream

    return errors


async def _dispatch(gw: HttpGateway, request: web.Request) -> web.StreamResponse:
    path = request.path
    if request.method == "HEAD":
        return web.Response(status=200)  # Claude Code's connectivity probe
    if path in ("/health", "/healthz", "/v1/health") and request.method == "GET":
        return web.json_response({"status": "ok"})
    if path.endswith("/models") and request.method == "GET":
        return web.json_response(
            {"object": "list", "data": [{"id": gw.model_name, "object": "model", "owned_by": "slime"}]}
        )
    for suffix, handler in ROUTES:
        if path.endswith(suffix):
            if request.method != "POST":
                raise BadRequest(f"{masked(path)}: use POST", status=405)
            session = await _authenticate(gw, request)
            with _admitted(gw, session.session_id):
                chunks, n = await read_body(gw, request)
                if gw.request_log:
                    _log_request(gw, request, parse_json_body(b"".join(chunks)))
                req = await _prepare(gw, suffix, chunks, n)
                return await handler(gw, request, session, req)
    raise BadRequest(f"no route for {request.method} {masked(path)}", status=404)


@contextlib.contextmanager
def _admitted(gw: HttpGateway, sid: str) -> Iterator[None]:
    n = gw.active.get(sid, 0)
    if n >= gw.max_session_requests:
        raise BadRequest(f"too many requests of this session in flight (at most {gw.max_session_requests})", 429)
    gw.active[sid] = n + 1
    try:
        yield
    finally:
        if gw.active[sid] <= 1:
            del gw.active[sid]
        else:
            gw.active[sid] -= 1


async def read_body(gw: HttpGateway, request: web.Request) -> tuple[list[bytes], int]:
    """The body as the chunks it arrived in (a large one is never copied into one piece on the loop)."""
    if request.content_length is not None and request.content_length > gw.max_body_bytes:
        raise BadRequest(f"request body over {gw.max_body_bytes} bytes", status=413)
    chunks: list[bytes] = []
    n = 0

    async def read() -> None:
        nonlocal n
        while chunk := await request.content.readany():
            n += len(chunk)
            if n > gw.max_body_bytes:
                raise BadRequest(f"request body over {gw.max_body_bytes} bytes", status=413)
            chunks.append(chunk)

    try:
        await asyncio.wait_for(read(), gw.body_timeout_s)
    except TimeoutError as e:
        raise BadRequest(f"request body not received within {gw.body_timeout_s:g}s", status=408) from e
    return chunks, n


async def _prepare(gw: HttpGateway, route: str, chunks: list[bytes], n: int) -> ApiRequest:
    """On the loop while it is cheap (a small body, then a small shape), else in a prepare worker."""
    if gw.pool is not None and gw.huge_pool is not None and not cheap_body(n):
        return await (gw.huge_pool if n > HUGE_BODY_BYTES else gw.pool).prepare(route, chunks, n)
    raw = b"".join(chunks)
    req = translate(route, raw)
    if gw.pool is not None and not cheap_shape(req):
        return await gw.pool.prepare(route, [raw], n)
    return measure(req, gw.builder, gw.limit, count=False)


async def _authenticate(gw: HttpGateway, request: web.Request) -> Session:
    path = request.path
    header_key = request.headers.get("x-api-key")
    auth = request.headers.get("Authorization", "")
    if auth[:7].lower() == "bearer ":
        header_key = auth[7:].strip() or header_key
    if m := _KEY_PREFIX.match(path):
        s = await gw.store.by_api_key(m.group(1)) if id_shaped(m.group(1)) else None
        if s is None:
            raise BadRequest("invalid API key", status=401)
    elif m := _SID_PREFIX.match(path):
        s = await _session_or_404(gw, m.group(1))
        if not same_secret(header_key, s.api_key):
            raise BadRequest("missing or wrong API key for this session", status=401)
    else:
        if not header_key:
            raise BadRequest("missing API key (Authorization: Bearer or x-api-key)", status=401)
        s = await gw.store.by_api_key(header_key) if id_shaped(header_key) else None
        if s is None:
            raise BadRequest("invalid API key", status=401)
    if s.finished:
        raise BadRequest(f"session {s.session_id} is finished", status=409)
    return s


async def _session_or_404(gw: HttpGateway, sid: str) -> Session:
    s = await gw.store.get(sid) if id_shaped(sid) else None
    if s is None:  # the id is echoed only when it has the shape of one of ours (never a client's junk)
        raise BadRequest(f"unknown session {sid!r}" if id_shaped(sid) else "unknown session", status=404)
    return s


def _log_request(gw: HttpGateway, request: web.Request, body: dict[str, Any]) -> None:
    """Captures of real clients (how `tests/fixtures/agent/` was recorded); credentials never written."""
    secret = {"authorization", "x-api-key", "cookie"}
    headers = {k: v for k, v in request.headers.items() if k.lower() not in secret}
    rec = {"time": time.time(), "method": request.method, "path": masked(request.path_qs), "headers": headers}
    rec["body"] = body
    with open(gw.request_log, "a") as f:  # type: ignore[arg-type]
        f.write(json.dumps(rec, ensure_ascii=False) + "\n")


# ---- admin -----------------------------------------------------------------------------------------------


def _check_admin(gw: HttpGateway, request: web.Request) -> None:
    auth = request.headers.get("Authorization", "")
    token = auth[7:].strip() if auth[:7].lower() == "bearer " else request.headers.get("x-admin-token")
    if not same_secret(token, gw.admin_token):
        raise BadRequest("admin token required", status=401)


async def _admin_create(gw: HttpGateway, request: web.Request) -> web.Response:
    _check_admin(gw, request)
    body = parse_json_body(b"".join((await read_body(gw, request))[0])) if request.can_read_body else {}
    defaults = sampling_defaults(body.get("sampling_defaults"))
    ctx = body.get("max_context_tokens", 0) or 0
    if isinstance(ctx, bool) or not isinstance(ctx, int) or ctx < 0:
        raise BadRequest("max_context_tokens: must be a non-negative integer")
    meta = body.get("metadata") or {}
    if not isinstance(meta, dict):
        raise BadRequest("metadata: must be an object")
    return web.json_response(await gw.open_session(defaults, ctx, meta))


async def _admin_session(gw: HttpGateway, request: web.Request) -> Session:
    _check_admin(gw, request)
    return await _session_or_404(gw, request.match_info["sid"])


async def _admin_get(gw: HttpGateway, request: web.Request) -> web.Response:
    return web.json_response((await _admin_session(gw, request)).info())


async def _admin_finish(gw: HttpGateway, request: web.Request) -> web.Response:
    """Also a retry's answer: a finished session's segments again, while the store keeps them."""
    s = await _admin_session(gw, request)
    segments = await gw.finish_session(s.session_id)
    return web.json_response({"session_id": s.session_id, "samples": [segment_to_json(g) for g in segments]})
