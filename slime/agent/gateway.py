"""The agent gateway: OpenAI (chat completions, Responses) and Anthropic (messages) APIs served from SGLang's
`/generate` with exact token capture, per-session credentials and an admin API.

Embeddable (a rollout function starts one on its own event loop with `start()`) or run as `slime gateway`.
Routes match on the path *suffix*, so any base-URL prefix works (agent-clients.md checklist 1). Client
mistakes get 4xx and never 5xx, because Claude Code retries 5xx for over a minute.

Credentials: `Authorization: Bearer <api_key>` or `x-api-key: <api_key>` (the real clients differ), or the
key as path prefix `/s/<api_key>/...` (the `base_url` the admin API returns, for clients that cannot set a
key), or `/sessions/<session_id>/...` together with the key in a header.

Each turn: route the request to one of the session's chains and build its prompt ids (`slime.agent.chains`,
`slime.agent.sessions`) under the session lock, generate without holding it, then record the engine's ids and
log-probs under the lock again. The store (`--agent-store`) may be shared by several gateway processes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import secrets
import time
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from slime.agent.chains import RequestHints, register_subagent_calls, route
from slime.agent.engine_client import EngineClient, EngineError
from slime.agent.messages import BadRequest, message_hash
from slime.agent.parsing import ParsedOutput, parse_model_output
from slime.agent.sessions import (
    ChainTurn,
    PromptBuilder,
    Session,
    SessionStore,
    StoreError,
    canonical_assistant,
    open_store,
    parsed_to_message,
)
from slime.agent.trajectory import TokenSegment, TurnRecord, segment_to_json

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 << 20
DEFAULT_MAX_NEW_TOKENS = 4096
FINISH_WAIT_S = 5.0
_KEY_PREFIX = re.compile(r"^/s/([^/]+)(/.*)?$")
_SID_PREFIX = re.compile(r"^/sessions/([^/]+)(/.*)?$")

Handler = Callable[["Gateway", web.Request, Session, dict[str, Any]], Awaitable[web.StreamResponse]]


@dataclass
class TurnResult:
    rid: str
    parsed: ParsedOutput
    finish_reason: str  # stop | length
    prompt_tokens: int
    completion_tokens: int


def _int_field(body: dict[str, Any], name: str) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise BadRequest(f"{name}: must be a positive integer")
    return v


def _num_field(body: dict[str, Any], name: str) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise BadRequest(f"{name}: must be a number")
    return float(v)


def _stop_field(body: dict[str, Any], name: str) -> list[str] | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, str):
        return [v]
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise BadRequest(f"{name}: must be a string or a list of strings")
    return v


def request_params(body: dict[str, Any], *, max_tokens: str, stop: str) -> dict[str, Any]:
    """Client sampling knobs, validated; the session's own defaults win over them later."""
    out: dict[str, Any] = {}
    if (v := _int_field(body, max_tokens)) is not None:
        out["max_new_tokens"] = v
    if max_tokens != "max_completion_tokens" and (v := _int_field(body, "max_completion_tokens")) is not None:
        out["max_new_tokens"] = v
    for name in ("temperature", "top_p"):
        if (v := _num_field(body, name)) is not None:
            out[name] = v
    if (v := _num_field(body, "top_k")) is not None:
        out["top_k"] = int(v)
    if (v := _stop_field(body, stop)) is not None:
        out["stop"] = v
    return out


def error_response(status: int, message: str, *, anthropic: bool = False) -> web.Response:
    if anthropic:
        kind = {401: "authentication_error", 404: "not_found_error", 413: "request_too_large"}.get(
            status, "invalid_request_error"
        )
        body: dict[str, Any] = {"type": "error", "error": {"type": kind, "message": message}}
    else:
        body = {"error": {"message": message, "type": "invalid_request_error", "code": status}}
    return web.json_response(body, status=status)


class Gateway:
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
        from slime.agent import anthropic_api, openai_api

        self.routes: list[tuple[str, Handler]] = [
            ("/chat/completions", openai_api.chat_completions),
            ("/responses", openai_api.responses),
            ("/messages/count_tokens", anthropic_api.count_tokens),
            ("/messages", anthropic_api.messages),
        ]
        app = web.Application(client_max_size=self.max_body_bytes, middlewares=[self._errors])
        app.router.add_post("/admin/sessions", self._admin_create)
        app.router.add_get("/admin/sessions/{sid}", self._admin_get)
        app.router.add_post("/admin/sessions/{sid}/finish", self._admin_finish)
        app.router.add_route("*", "/{tail:.*}", self._dispatch)
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        anthropic = "/messages" in request.path
        try:
            return await handler(request)
        except BadRequest as e:
            return error_response(e.status, str(e), anthropic=anthropic)
        except (EngineError, StoreError) as e:
            logger.warning("%s on %s: %s", type(e).__name__, request.path, e)
            return error_response(e.status, str(e), anthropic=anthropic)
        except web.HTTPRequestEntityTooLarge:
            return error_response(413, f"request body over {self.max_body_bytes} bytes", anthropic=anthropic)

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
        for suffix, handler in self.routes:
            if path.endswith(suffix):
                if request.method != "POST":
                    raise BadRequest(f"{path}: use POST", status=405)
                session = await self._authenticate(request)
                body = await self._json_body(request)
                if self.request_log:
                    self._log_request(request, body)
                return await handler(self, request, session, body)
        raise BadRequest(f"no route for {request.method} {path}", status=404)

    async def _authenticate(self, request: web.Request) -> Session:
        path = request.path
        header_key = request.headers.get("x-api-key")
        auth = request.headers.get("Authorization", "")
        if auth[:7].lower() == "bearer ":
            header_key = auth[7:].strip() or header_key
        if m := _KEY_PREFIX.match(path):
            s = await self.store.by_api_key(m.group(1))
            if s is None:
                raise BadRequest("invalid API key", status=401)
        elif m := _SID_PREFIX.match(path):
            s = await self.store.get(m.group(1))
            if s is None:
                raise BadRequest(f"unknown session {m.group(1)!r}", status=404)
            if header_key != s.api_key:
                raise BadRequest("missing or wrong API key for this session", status=401)
        else:
            if not header_key:
                raise BadRequest("missing API key (Authorization: Bearer or x-api-key)", status=401)
            s = await self.store.by_api_key(header_key)
            if s is None:
                raise BadRequest("invalid API key", status=401)
        if s.finished:
            raise BadRequest(f"session {s.session_id} is finished", status=409)
        return s

    def _log_request(self, request: web.Request, body: dict[str, Any]) -> None:
        """Captures of real clients (how `tests/fixtures/agent/` was recorded); credentials never written."""
        secret = {"authorization", "x-api-key", "cookie"}
        headers = {k: v for k, v in request.headers.items() if k.lower() not in secret}
        path = _KEY_PREFIX.sub(lambda m: "/s/***" + (m.group(2) or ""), request.path_qs)
        rec = {"time": time.time(), "method": request.method, "path": path, "headers": headers, "body": body}
        with open(self.request_log, "a") as f:  # type: ignore[arg-type]
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")

    async def _json_body(self, request: web.Request) -> dict[str, Any]:
        raw = await request.read()  # raises 413 past client_max_size
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadRequest(f"body: invalid JSON ({e})") from e
        if not isinstance(body, dict):
            raise BadRequest("body: must be a JSON object")
        return body

    # ---- admin -----------------------------------------------------------------------------------------
    def _check_admin(self, request: web.Request) -> None:
        auth = request.headers.get("Authorization", "")
        token = auth[7:].strip() if auth[:7].lower() == "bearer " else request.headers.get("x-admin-token")
        if not self.admin_token or token != self.admin_token:
            raise BadRequest("admin token required", status=401)

    async def _admin_create(self, request: web.Request) -> web.Response:
        self._check_admin(request)
        body = await self._json_body(request) if request.can_read_body else {}
        defaults = body.get("sampling_defaults") or {}
        if not isinstance(defaults, dict):
            raise BadRequest("sampling_defaults: must be an object")
        ctx = body.get("max_context_tokens", 0) or 0
        if isinstance(ctx, bool) or not isinstance(ctx, int) or ctx < 0:
            raise BadRequest("max_context_tokens: must be a non-negative integer")
        meta = body.get("metadata") or {}
        if not isinstance(meta, dict):
            raise BadRequest("metadata: must be an object")
        return web.json_response(await self.open_session(defaults, ctx, meta))

    async def _admin_session(self, request: web.Request) -> Session:
        self._check_admin(request)
        s = await self.store.get(request.match_info["sid"])
        if s is None:
            raise BadRequest(f"unknown session {request.match_info['sid']!r}", status=404)
        return s

    async def _admin_get(self, request: web.Request) -> web.Response:
        return web.json_response((await self._admin_session(request)).info())

    async def _admin_finish(self, request: web.Request) -> web.Response:
        s = await self._admin_session(request)
        if s.finished:
            raise BadRequest(f"session {s.session_id} is already finished", status=409)
        segments = await self.finish_session(s.session_id)
        return web.json_response({"session_id": s.session_id, "samples": [segment_to_json(g) for g in segments]})
