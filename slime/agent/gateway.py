"""The agent gateway: OpenAI (chat completions, Responses) and Anthropic (messages) APIs served from SGLang's
`/generate` with exact token capture, per-session credentials and an admin API (all described for users in
docs/agent.md). Its HTTP side (routes, credentials, admission, bodies, admin routes) is
`slime.agent.gateway_http`; this module is the gateway itself: lifecycle, sessions and turns.

Embeddable (a rollout function starts one on its own event loop with `start()`) or run as `slime gateway`.

Each turn: route the request to one of the session's chains and build its prompt ids (`slime.agent.chains`,
`slime.agent.prompts`) under the session lock, generate without holding it, then record the engine's ids and
log-probs under the lock again. The store (`--agent-store`) may be shared by several gateway processes. A
request that repeats a chain's newest request exactly is a client's retry (its answer was lost, e.g. with a
gateway process that died): it is answered from the recorded turn, so a retry never adds a turn.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Collection
from typing import Any

from aiohttp import web

from slime.agent import gateway_http
from slime.agent.api import ApiRequest, TurnResult
from slime.agent.chains import register_subagent_calls, route
from slime.agent.context_limit import ContextLimit, config_context_length, max_token_bytes
from slime.agent.engine_client import EngineClient, EngineError
from slime.agent.messages import BadRequest
from slime.agent.parsing import parse_model_output
from slime.agent.prepare_pool import PreparePool
from slime.agent.prompts import PromptBuilder, canonical_assistant, parsed_to_message
from slime.agent.session import ChainTurn, Session
from slime.agent.stores import SessionStore, open_store
from slime.agent.trajectory import TokenSegment, TurnRecord, segment_from_json, segment_to_json

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 << 20
DEFAULT_MAX_NEW_TOKENS = 4096
FINISH_WAIT_S = 5.0
PREPARE_WORKERS = 2
BODY_TIMEOUT_S = 60.0
INLINE_PLAN_CHARS = 4096  # ~2 ms of tokenizing at most
MAX_SESSION_REQUESTS = 16  # Claude Code runs a handful of sub-agents at once; more is a client gone wrong


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
        context_length: int | None = None,
        prepare_workers: int = PREPARE_WORKERS,
        body_timeout_s: float = BODY_TIMEOUT_S,
        max_session_requests: int = MAX_SESSION_REQUESTS,
    ) -> None:
        """`store`: a `SessionStore`, or an `--agent-store` URL (memory | redis://...) the gateway opens and
        closes itself. `aux_models`: model names served but never trained (small/fast-model calls).
        `request_log`: append every API request (credentials masked) to this JSONL file. `context_length`:
        the prompt limit; by default the served model's (the engine's `/v1/models`, else the checkpoint's
        config). `prepare_workers`: processes per lane that prepare large bodies off the event loop (0: none,
        all on the loop). `body_timeout_s`: a body not received in this time is answered 408.
        `max_session_requests`: requests of one session in flight at once in this process (429 beyond)."""
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
        self.context_length = context_length
        self.prepare_workers = prepare_workers
        self.body_timeout_s = body_timeout_s
        self.max_session_requests = max_session_requests
        self.limit = ContextLimit(context_length or 0, None)  # set for good in start()
        self.pool: PreparePool | None = None  # bodies up to HUGE_BODY_BYTES
        self.huge_pool: PreparePool | None = None  # larger ones, idle-class
        self._runner: web.AppRunner | None = None
        self._counter = 0
        self._tag = secrets.token_hex(2)  # keeps request ids unique across gateway processes sharing a store
        self._tasks: dict[str, asyncio.Task] = {}  # in-flight turns of this process, by request id
        self.active: dict[str, int] = {}  # requests in flight per session (admission)
        self.app = gateway_http.build_app(self)

    # ---- lifecycle -------------------------------------------------------------------------------------
    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        ctx = self.context_length or await self.engine.context_length()
        ctx = ctx or config_context_length(getattr(self.tokenizer, "name_or_path", "") or ".")
        if not ctx:
            raise ValueError("the served model's context length is unknown: pass context_length")
        self.context_length = ctx
        self.limit = ContextLimit(ctx, max_token_bytes(self.tokenizer))
        if self.prepare_workers > 0:
            self.pool = PreparePool(self.tokenizer, self.limit, self.prepare_workers)
            self.huge_pool = PreparePool(self.tokenizer, self.limit, self.prepare_workers, idle=True)
        # handler_cancellation: a client that disconnects cancels its handler, which aborts the engine call
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        if self.public_url is None:
            self.public_url = f"http://{host}:{bound}"
        logger.info("agent gateway on %s (engine %s, context %d tokens)", self.public_url, self.engine.url, ctx)
        return self.public_url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        for pool in (self.pool, self.huge_pool):
            if pool is not None:
                await pool.close()
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

        Idempotent and resumable: a repeated call (its first answer lost, or its first caller gone midway,
        on any process) returns the same segments while the store keeps them (`result_ttl_s`)."""
        async with self.store.locked(session_id) as st:  # KeyError for an unknown session
            sealed = st.sealed
            st.finished = True
            waiting = [] if sealed else list(st.inflight)
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
            done = await self.store.result(session_id)
            if done is None:
                if st.sealed and not st.chains and not st.frozen and st.num_turns:
                    raise BadRequest(f"session {session_id} is finished; its segments are no longer kept", 409)
                st.sealed = True  # from here on a late answer is not recorded
                await self.store.load_turns(st)
                segments = st.segments()
        if done is not None:
            return [segment_from_json(g) for g in done]
        await self.store.remove(session_id, [segment_to_json(g) for g in segments])
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
        # SGLang refuses input + max_new_tokens over the context: the answer gets the room there is
        params["max_new_tokens"] = min(cap, self.limit.context_length - prompt_len)
        return params

    def _result(self, rid: str, record: TurnRecord, req: ApiRequest, engine_ms: float) -> TurnResult:
        ids = record.output_ids
        body = ids[:-1] if ids and ids[-1] == self.builder.eos_id else ids
        raw = self.tokenizer.decode(body, skip_special_tokens=False)
        parsed = parse_model_output(raw, [t["function"]["name"] for t in req.tools])
        finish = "length" if record.finish_reason == "length" else "stop"
        return TurnResult(rid, parsed, finish, len(record.prompt_ids), len(ids), engine_ms)

    async def run_turn(self, s: Session, req: ApiRequest, rid: str | None = None) -> TurnResult:
        """Route the request to a chain and build its prompt (under the session lock), generate (without
        it, so parallel sub-agents of one session generate concurrently), then record the turn (locked)."""
        rid = rid or self.new_rid(s)
        task = asyncio.current_task()
        if task is not None:
            self._tasks[rid] = task  # before anything is awaited: finish may cancel it from here on
        recorded = False
        try:
            chain_id, prompt_ids, replay = await self._plan_turn(s.session_id, rid, req)
            if replay is not None:
                recorded = True  # nothing of this request was marked in flight
                return self._result(replay.rid, replay.record, req, 0.0)
            params = self._sampling_params(s, req.params, len(prompt_ids))
            engine_ms = 0.0
            if params["max_new_tokens"] <= 0:
                ids, lps, finish = [], [], "length"  # no room left in the context: an empty, truncated turn
            else:
                t0 = asyncio.get_running_loop().time()
                res = await self.engine.generate(prompt_ids, params, rid=rid, routing_key=s.session_id)
                engine_ms = (asyncio.get_running_loop().time() - t0) * 1e3
                if res.finish_reason == "abort":
                    raise EngineError("generation aborted by the engine", status=503)
                ids, lps, finish = res.output_ids, res.log_probs, res.finish_reason
            record = TurnRecord(list(prompt_ids), list(ids), list(lps), finish)
            result = self._result(rid, record, req, engine_ms)
            response = canonical_assistant(parsed_to_message(result.parsed))
            turn = ChainTurn(record, req.hashes, req.tools_hash, req.text, response, rid)
            async with self.store.locked(s.session_id) as st:
                if st.sealed:
                    raise BadRequest("session is finished", status=409)
                if rid in st.inflight:
                    st.inflight.remove(rid)
                st.add_turn(chain_id, turn)
                register_subagent_calls(st, chain_id, rid, result.parsed)
            recorded = True
        finally:
            self._tasks.pop(rid, None)
            if not recorded:
                await self._forget_inflight(s.session_id, rid)
        return result

    async def _plan_turn(self, sid: str, rid: str, req: ApiRequest) -> tuple[str, list[int], ChainTurn | None]:
        """(chain id, prompt ids, None), with `rid` marked in flight; or (chain id, [], the recorded turn) when
        the request repeats that chain's newest request exactly (a retry)."""
        async with self.store.locked(sid) as st:
            if st.finished:
                raise BadRequest("session is finished", status=409)
            st.num_requests += 1
            chain_id = route(st, req.hints, req.hashes, self.aux_models)
            last = st.last_turn(chain_id)
            if last is not None and last.rid and last.hashes == req.hashes and last.tools_hash == req.tools_hash:
                logger.debug("session %s: request repeats turn %s, answered from its record", sid, last.rid)
                return chain_id, [], last
            try:  # a long prompt in a thread (the tokenizer releases the GIL: other sessions go on meanwhile);
                # a short one here, where a thread would cost more than it saves (its hop, the GIL handed back)
                if len(req.text) > INLINE_PLAN_CHARS:
                    action, prompt_ids = await asyncio.to_thread(self.builder.plan, last, req)
                else:
                    action, prompt_ids = self.builder.plan(last, req)
            except BadRequest:
                raise
            except Exception as e:  # the chat template rejected the messages (e.g. roles out of order)
                raise BadRequest(f"messages: cannot be rendered with the model's chat template: {e}") from e
            self.limit.check_ids(len(prompt_ids))
            if action == "wipe":
                st.freeze(chain_id, st.wipe_kind(chain_id))
            st.inflight.append(rid)
        logger.debug("session %s turn %s: %s on chain %s, %d prompt ids", sid, rid, action, chain_id, len(prompt_ids))
        return chain_id, prompt_ids, None

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

    async def count_tokens(self, req: ApiRequest) -> int:
        if req.ids is not None:
            return len(req.ids)
        return len(await asyncio.to_thread(self.builder.encode, req.text))
