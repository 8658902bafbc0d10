"""The agent gateway: OpenAI (chat completions, Responses) and Anthropic (messages) APIs served from SGLang's
`/generate` with exact token capture, per-session credentials and an admin API (all described for users in
docs/agent.md).

Embeddable (a rollout function starts one on its own event loop with `start()`) or run as `slime gateway`.
Routes match on the path *suffix*, so any base-URL prefix a client adds (`/v1`, `/api/v1`, none) works.
Client mistakes get 4xx and never 5xx, because Claude Code retries 5xx for over a minute; error bodies take
the shape of the API asked (`slime.agent.api.error_body`) and never name the engine's address.

Credentials: `Authorization: Bearer <api_key>` or `x-api-key: <api_key>` (the real clients differ), or the
key as path prefix `/s/<api_key>/...` (the `base_url` the admin API returns, for clients that cannot set a
key), or `/sessions/<session_id>/...` together with the key in a header. A key is never logged: paths are
masked before they reach a log line.

Each turn: route the request to one of the session's chains and build its prompt ids (`slime.agent.chains`,
`slime.agent.prompts`) under the session lock, generate without holding it, then record the engine's ids and
log-probs under the lock again. The store (`--agent-store`) may be shared by several gateway processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import re
import secrets
import time
from collections.abc import Collection
from typing import Any

from aiohttp import web

from slime.agent import anthropic_api, openai_api
from slime.agent.api import (
    ADMIN,
    ANTHROPIC,
    OPENAI,
    Handler,
    TurnResult,
    error_body,
    error_response,
    parse_json_body,
    public_error,
    sampling_defaults,
    send,
    sse_of,
)
from slime.agent.chains import RequestHints, register_subagent_calls, route
from slime.agent.engine_client import EngineClient, EngineError
from slime.agent.messages import BadRequest, message_hash
from slime.agent.parsing import parse_model_output
from slime.agent.prompts import PromptBuilder, canonical_assistant, parsed_to_message
from slime.agent.session import ChainTurn, Session
from slime.agent.stores import SessionStore, StoreError, id_shaped, open_store
from slime.agent.trajectory import TokenSegment, TurnRecord, segment_to_json

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 << 20
DEFAULT_MAX_NEW_TOKENS = 4096
FINISH_WAIT_S = 5.0
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


class Gateway:
    """One gateway: its HTTP app, its engine client, its session store, and the turns it has in flight."""

    def __init__(
        self,
        tokenizer: Any,
        engine_url: str,
        *,
        admin_token: str | None = None,
        store: SessionStore | str | None = None,
        model_name: str = "slime-policy",
        max_body_bytes: int = MAX_BODY_BYTES,
        default_max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
        public_url: str | None = None,
        aux_models: Collection[str] = (),
        request_log: str | None = None,
    ) -> None:
        """`store`: a `SessionStore`, or an `--agent-store` URL (memory | redis://...) the gateway opens and
        closes itself. `aux_models`: model names served but never trained (small/fast-model calls).
        `request_log`: append every API request (credentials masked) to this JSONL file."""
        self.tokenizer = tokenizer
        self.builder = PromptBuilder(tokenizer)
        self.engine = EngineClient(engine_url)
        self.admin_token = admin_token
        self._owns_store = store is None or isinstance(store, str)
        self.store: SessionStore = open_store(store) if store is None or isinstance(store, str) else store
        self.model_name = model_name
        self.max_body_bytes = max_body_bytes
        self.default_max_new_tokens = default_max_new_tokens
        self.public_url = public_url
        self.aux_models = frozenset(aux_models)
        self.request_log = request_log
        self._runner: web.AppRunner | None = None
        self._counter = 0
        self._tag = secrets.token_hex(2)  # keeps request ids unique across gateway processes sharing a store
        self._tasks: dict[str, asyncio.Task] = {}  # in-flight turns of this process, by request id
        self.app = self._build_app()

    # ---- lifecycle -------------------------------------------------------------------------------------
    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        # handler_cancellation: a client that disconnects cancels its handler, which aborts the engine call
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        if self.public_url is None:
            self.public_url = f"http://{host}:{bound}"
        logger.info("agent gateway on %s (engine %s)", self.public_url, self.engine.url)
        return self.public_url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        await self.engine.close()
        if self._owns_store:
            await self.store.close()

    # ---- sessions (Python API; the admin routes call these) ---------------------------------------------
    async def open_session(
        self,
        sampling_defaults: dict[str, Any] | None = None,
        max_context_tokens: int = 0,
        metadata: dict[str, Any] | None = None,
    ) -> dict[str, str]:
        s = await self.store.create(
            sampling_defaults={k: v for k, v in (sampling_defaults or {}).items() if v is not None},
            max_context_tokens=max_context_tokens or 0,
            metadata=metadata or {},
        )
        base = (self.public_url or "").rstrip("/")
        return {"session_id": s.session_id, "api_key": s.api_key, "base_url": f"{base}/s/{s.api_key}"}

    async def finish_session(self, session_id: str) -> list[TokenSegment]:
        """Close the session (later requests get 409), let in-flight turns end (≤5 s, then cancel them, or
        abort them at the engine when another gateway process serves them) and return the merged segments.
        Idempotent: a second call returns []."""
        async with self.store.locked(session_id) as st:  # KeyError for an unknown session
            if st.finished:
                return []
            st.finished = True
            waiting = list(st.inflight)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + FINISH_WAIT_S
        while waiting and loop.time() < deadline:
            await asyncio.sleep(0.02)
            snap = await self.store.get(session_id)
            waiting = list(snap.inflight) if snap is not None else []
        for rid in waiting:
            task = self._tasks.get(rid)
            if task is not None:
                task.cancel()  # its engine request is aborted by the client's cancellation path
            else:
                await self.engine.abort(rid)
        async with self.store.locked(session_id) as st:
            st.sealed = True  # from here on a late answer is not recorded
            await self.store.load_turns(st)
            segments = st.segments()
        await self.store.remove(session_id)
        return segments

    # ---- one turn --------------------------------------------------------------------------------------
    def _sampling_params(self, s: Session, client: dict[str, Any], prompt_len: int) -> dict[str, Any]:
        params: dict[str, Any] = {
            "skip_special_tokens": False,
            "spaces_between_special_tokens": False,
            "no_stop_trim": True,
        }
        params.update({k: v for k, v in client.items() if k != "max_new_tokens"})
        params.update(s.sampling_defaults)  # the rollout's sampling params: what the trainer assumes
        cap = s.sampling_defaults.get("max_new_tokens") or self.default_max_new_tokens
        if client.get("max_new_tokens"):
            cap = min(cap, client["max_new_tokens"])
        if s.max_context_tokens > 0:
            cap = min(cap, s.max_context_tokens - prompt_len)
        params["max_new_tokens"] = cap
        return params

    async def run_turn(
        self,
        s: Session,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]],
        client_params: dict[str, Any],
        rid: str | None = None,
        hints: RequestHints | None = None,
    ) -> TurnResult:
        """Route the request to a chain and build its prompt (under the session lock), generate (without
        it, so parallel sub-agents of one session generate concurrently), then record the turn (locked)."""
        rid = rid or self.new_rid(s)
        task = asyncio.current_task()
        if task is not None:
            self._tasks[rid] = task  # before anything is awaited: finish may cancel it from here on
        recorded = False
        try:
            chain_id, prompt_ids, turn_meta = await self._plan_turn(s.session_id, rid, messages, tools, hints)
            params = self._sampling_params(s, client_params, len(prompt_ids))
            if params["max_new_tokens"] <= 0:
                ids, lps, finish = [], [], "length"  # no room left in the context: an empty, truncated turn
            else:
                res = await self.engine.generate(prompt_ids, params, rid=rid, routing_key=s.session_id)
                if res.finish_reason == "abort":
                    raise EngineError("generation aborted by the engine", status=503)
                ids, lps, finish = res.output_ids, res.log_probs, res.finish_reason
            body = ids[:-1] if ids and ids[-1] == self.builder.eos_id else ids
            raw = self.tokenizer.decode(body, skip_special_tokens=False)
            parsed = parse_model_output(raw, [t["function"]["name"] for t in tools])
            record = TurnRecord(list(prompt_ids), list(ids), list(lps), finish)
            turn = ChainTurn(record, *turn_meta, canonical_assistant(parsed_to_message(parsed)))
            async with self.store.locked(s.session_id) as st:
                if st.sealed:
                    raise BadRequest("session is finished", status=409)
                if rid in st.inflight:
                    st.inflight.remove(rid)
                st.add_turn(chain_id, turn)
                register_subagent_calls(st, chain_id, rid, parsed)
            recorded = True
        finally:
            self._tasks.pop(rid, None)
            if not recorded:
                await self._forget_inflight(s.session_id, rid)
        return TurnResult(rid, parsed, "length" if finish == "length" else "stop", len(prompt_ids), len(ids))

    async def _plan_turn(
        self,
        sid: str,
        rid: str,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]],
        hints: RequestHints | None,
    ) -> tuple[str, list[int], tuple[list[str], str, str]]:
        """(chain id, prompt ids, (hashes, tools hash, prompt text)); marks `rid` in flight."""
        hashes = [message_hash(m) for m in messages]
        async with self.store.locked(sid) as st:
            if st.finished:
                raise BadRequest("session is finished", status=409)
            st.num_requests += 1
            chain_id = route(st, hints or RequestHints(), hashes, self.aux_models)
            try:
                action, prompt_ids, hashes, th, text = self.builder.plan(
                    st.last_turn(chain_id), messages, tools, hashes
                )
            except BadRequest:
                raise
            except Exception as e:  # the chat template rejected the messages (e.g. roles out of order)
                raise BadRequest(f"messages: cannot be rendered with the model's chat template: {e}") from e
            if action == "wipe":
                st.freeze(chain_id, st.wipe_kind(chain_id))
            st.inflight.append(rid)
        logger.debug("session %s turn %s: %s on chain %s, %d prompt ids", sid, rid, action, chain_id, len(prompt_ids))
        return chain_id, prompt_ids, (hashes, th, text)

    async def _forget_inflight(self, sid: str, rid: str) -> None:
        try:
            async with self.store.locked(sid) as st:
                if rid in st.inflight:
                    st.inflight.remove(rid)
        except Exception as e:  # the store is gone (shutdown): finish will wait out its 5 s and move on
            logger.warning("could not clear in-flight turn %s of %s: %r", rid, sid, e)

    def new_rid(self, s: Session) -> str:
        """Engine request id, unique across gateway processes; also the id of the protocol answer, so a
        client-side id maps to the engine call."""
        self._counter += 1
        return f"{s.session_id}-{self._tag}{self._counter}"

    def count_tokens(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> int:
        return len(self.builder.encode(self.builder.render(messages, tools, gen=True)))

    # ---- HTTP ------------------------------------------------------------------------------------------
    def _build_app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body_bytes, middlewares=[self._errors])
        app.router.add_post("/admin/sessions", self._admin_create)
        app.router.add_get("/admin/sessions/{sid}", self._admin_get)
        app.router.add_post("/admin/sessions/{sid}/finish", self._admin_finish)
        app.router.add_route("*", "/{tail:.*}", self._dispatch)
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """Every error becomes an answer in the API's own shape: in-band once an event stream started."""
        try:
            return await handler(request)
        except web.HTTPException as e:  # aiohttp's own: 413 from reading the body, 405, ...
            if e.status < 400:
                raise
            status = e.status
            message = f"request body over {self.max_body_bytes} bytes" if status == 413 else e.reason
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

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        if request.method == "HEAD":
            return web.Response(status=200)  # Claude Code's connectivity probe
        if path in ("/health", "/healthz", "/v1/health") and request.method == "GET":
            return web.json_response({"status": "ok"})
        if path.endswith("/models") and request.method == "GET":
            return web.json_response(
                {"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "slime"}]}
            )
        for suffix, handler in ROUTES:
            if path.endswith(suffix):
                if request.method != "POST":
                    raise BadRequest(f"{masked(path)}: use POST", status=405)
                session = await self._authenticate(request)
                body = await self._json_body(request)
                if self.request_log:
                    self._log_request(request, body)
                return await handler(self, request, session, body)
        raise BadRequest(f"no route for {request.method} {masked(path)}", status=404)

    async def _authenticate(self, request: web.Request) -> Session:
        path = request.path
        header_key = request.headers.get("x-api-key")
        auth = request.headers.get("Authorization", "")
        if auth[:7].lower() == "bearer ":
            header_key = auth[7:].strip() or header_key
        if m := _KEY_PREFIX.match(path):
            s = await self.store.by_api_key(m.group(1)) if id_shaped(m.group(1)) else None
            if s is None:
                raise BadRequest("invalid API key", status=401)
        elif m := _SID_PREFIX.match(path):
            s = await self._session_or_404(m.group(1))
            if not same_secret(header_key, s.api_key):
                raise BadRequest("missing or wrong API key for this session", status=401)
        else:
            if not header_key:
                raise BadRequest("missing API key (Authorization: Bearer or x-api-key)", status=401)
            s = await self.store.by_api_key(header_key) if id_shaped(header_key) else None
            if s is None:
                raise BadRequest("invalid API key", status=401)
        if s.finished:
            raise BadRequest(f"session {s.session_id} is finished", status=409)
        return s

    async def _session_or_404(self, sid: str) -> Session:
        s = await self.store.get(sid) if id_shaped(sid) else None
        if s is None:  # the id is echoed only when it has the shape of one of ours (never a client's junk)
            raise BadRequest(f"unknown session {sid!r}" if id_shaped(sid) else "unknown session", status=404)
        return s

    def _log_request(self, request: web.Request, body: dict[str, Any]) -> None:
        """Captures of real clients (how `tests/fixtures/agent/` was recorded); credentials never written."""
        secret = {"authorization", "x-api-key", "cookie"}
        headers = {k: v for k, v in request.headers.items() if k.lower() not in secret}
        rec = {"time": time.time(), "method": request.method, "path": masked(request.path_qs), "headers": headers}
        rec["body"] = body
        with open(self.request_log, "a") as f:  # type: ignore[arg-type]
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")

    async def _json_body(self, request: web.Request) -> dict[str, Any]:
        return parse_json_body(await request.read())  # read() raises 413 past client_max_size

    # ---- admin -----------------------------------------------------------------------------------------
    def _check_admin(self, request: web.Request) -> None:
        auth = request.headers.get("Authorization", "")
        token = auth[7:].strip() if auth[:7].lower() == "bearer " else request.headers.get("x-admin-token")
        if not same_secret(token, self.admin_token):
            raise BadRequest("admin token required", status=401)

    async def _admin_create(self, request: web.Request) -> web.Response:
        self._check_admin(request)
        body = await self._json_body(request) if request.can_read_body else {}
        defaults = sampling_defaults(body.get("sampling_defaults"))
        ctx = body.get("max_context_tokens", 0) or 0
        if isinstance(ctx, bool) or not isinstance(ctx, int) or ctx < 0:
            raise BadRequest("max_context_tokens: must be a non-negative integer")
        meta = body.get("metadata") or {}
        if not isinstance(meta, dict):
            raise BadRequest("metadata: must be an object")
        return web.json_response(await self.open_session(defaults, ctx, meta))

    async def _admin_session(self, request: web.Request) -> Session:
        self._check_admin(request)
        return await self._session_or_404(request.match_info["sid"])

    async def _admin_get(self, request: web.Request) -> web.Response:
        return web.json_response((await self._admin_session(request)).info())

    async def _admin_finish(self, request: web.Request) -> web.Response:
        s = await self._admin_session(request)
        if s.finished:
            raise BadRequest(f"session {s.session_id} is already finished", status=409)
        segments = await self.finish_session(s.session_id)
        return web.json_response({"session_id": s.session_id, "samples": [segment_to_json(g) for g in segments]})
