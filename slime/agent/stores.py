"""Where sessions live: in this process (`memory`) or in Redis, shared by several gateway processes.

Every change to a session happens inside `store.locked(session_id)`, which yields the current state and
persists it on exit; generation runs outside the lock, so parallel sub-agents of one session generate
concurrently.

Why Redis: an agent's requests may land on any gateway process (a load balancer in front of several, or a
client that reconnects elsewhere), and finish may be called on yet another one. Everything a turn needs
is therefore shared: the session's settings and routing state, its turn records and its lock.

Redis layout (prefix `slime:agent:` by default):

* `s:{sid}` hash: `meta` (credential, sampling defaults, context budget, metadata) and `state` (the routing
  state of `slime.agent.session.state_to_json`: chains as turn-id lists, frozen contexts, pending sub-agent
  calls, in-flight request ids, flags). Small, rewritten on every locked change.
* `s:{sid}:turns` list: the turn log, append-only (RPUSH), one JSON entry per engine call; a turn's id is
  its position. Routing loads only each live chain's newest entry (LINDEX); finish loads them all.
* `s:{sid}:lock`: the per-session lock, `SET NX PX` with a random token. Critical sections are short (route +
  prompt build, then commit; generation runs unlocked), so the TTL only matters when a process dies holding it.
* `k:{api_key}` -> sid.
* `s:{sid}:result`: what `finish` returned (the segments' JSON), written with the turn log's removal in one
  transaction and kept `result_ttl_s`, so a finish retried after its answer was lost returns it again.

Writes are fenced: the state and new turns are written in one MULTI/EXEC under WATCH of the lock key, after
checking the token, so a process whose lock expired cannot overwrite a newer state. No Lua (fakeredis runs
the same code in unit tests without a Lua runtime). Keys expire `session_ttl_s` after the last change;
finished sessions leave a tombstone for `tombstone_ttl_s` so late requests get 409. Redis being unreachable
(restarting, loading its data back) is a `StoreError`: the client gets 503 and retries.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import re
import secrets
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

from slime.agent.session import Session, load_state, state_to_json, turn_from_json, turn_to_json

_ID_SHAPE = re.compile(r"[A-Za-z0-9_-]{1,128}")


class StoreError(Exception):
    """The session store failed (lock not acquired, lock lost, records missing): the gateway answers 503."""

    status = 503


class SessionStore(Protocol):
    async def create(
        self, *, sampling_defaults: dict[str, Any], max_context_tokens: int, metadata: dict[str, Any]
    ) -> Session: ...

    async def get(self, session_id: str) -> Session | None:
        """A snapshot of the session (flags, routing state); change it only through `locked`."""
        ...

    async def by_api_key(self, api_key: str) -> Session | None: ...

    def locked(self, session_id: str) -> AbstractAsyncContextManager[Session]:
        """Exclusive access across every process sharing the store: yields the current state with each live
        chain's newest turn loaded, and persists it (state + new turns) when the block exits without error.
        Raises KeyError for an unknown session."""
        ...

    async def load_turns(self, session: Session) -> None:
        """Load every turn record into `session.turns` (to build segments)."""
        ...

    async def remove(self, session_id: str, result: list[dict[str, Any]]) -> None:
        """Drop the session's data and keep `result` (what finish returned) for a while; keep a tombstone so
        late requests get 409."""
        ...

    async def result(self, session_id: str) -> list[dict[str, Any]] | None:
        """What `remove` kept, while it is kept."""
        ...

    async def close(self) -> None: ...


def new_credentials() -> tuple[str, str]:
    """(session id, API key). Both are URL-safe ASCII, so either can stand in a request path."""
    return f"sess-{secrets.token_hex(8)}", f"sk-slime-{secrets.token_urlsafe(24)}"


def id_shaped(value: str) -> bool:
    """Whether `value` can be a session id or API key this module handed out: anything else is refused before
    it reaches a store (a Redis key cannot hold a lone surrogate, and a lookup of junk is wasted work)."""
    return _ID_SHAPE.fullmatch(value) is not None


class InMemorySessionStore:
    """Sessions of one gateway process. Finished sessions stay as tombstones so late requests get 409; what
    their finish returned is kept `result_ttl_s`."""

    def __init__(self, result_ttl_s: float = 600.0) -> None:
        self._by_id: dict[str, Session] = {}
        self._by_key: dict[str, str] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self.result_ttl_s = result_ttl_s
        self._results: dict[str, list[dict[str, Any]]] = {}
        self._expiry: collections.deque[tuple[float, str]] = collections.deque()

    async def create(
        self, *, sampling_defaults: dict[str, Any], max_context_tokens: int, metadata: dict[str, Any]
    ) -> Session:
        sid, key = new_credentials()
        s = Session(sid, key, dict(sampling_defaults), int(max_context_tokens), dict(metadata))
        self._by_id[sid] = s
        self._by_key[key] = sid
        self._locks[sid] = asyncio.Lock()
        return s

    async def get(self, session_id: str) -> Session | None:
        return self._by_id.get(session_id)

    async def by_api_key(self, api_key: str) -> Session | None:
        sid = self._by_key.get(api_key)
        return self._by_id.get(sid) if sid is not None else None

    @contextlib.asynccontextmanager
    async def locked(self, session_id: str) -> AsyncIterator[Session]:
        s = self._by_id.get(session_id)
        if s is None:
            raise KeyError(session_id)
        async with self._locks[session_id]:
            yield s
            s.new_turns.clear()

    async def load_turns(self, session: Session) -> None:
        return None  # everything is in memory already

    async def remove(self, session_id: str, result: list[dict[str, Any]]) -> None:
        s = self._by_id.get(session_id)
        if s is not None:  # drop the data, keep the tombstone
            s.chains, s.frozen, s.pending, s.turns = {}, [], {}, {}
            now = time.monotonic()
            self._results[session_id] = result
            self._expiry.append((now + self.result_ttl_s, session_id))
            while self._expiry and self._expiry[0][0] < now:
                self._results.pop(self._expiry.popleft()[1], None)

    async def result(self, session_id: str) -> list[dict[str, Any]] | None:
        return self._results.get(session_id)

    async def close(self) -> None:
        return None


@contextlib.contextmanager
def _reachable() -> Iterator[None]:
    """Redis down, restarting or still loading its data: a StoreError (503, the client retries), not a 500."""
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError

    try:
        yield
    except (RedisConnectionError, RedisTimeoutError, OSError) as e:
        raise StoreError(f"the session store is unavailable ({type(e).__name__})") from e


def open_store(url: str | None) -> SessionStore:
    """`--agent-store`: unset or `memory` -> in-process; `redis://...` (or `rediss://`, `unix://`) -> Redis."""
    if not url or url == "memory":
        return InMemorySessionStore()
    if url.startswith(("redis://", "rediss://", "unix://")):
        return RedisSessionStore(url)
    raise ValueError("--agent-store: use 'memory' or a redis:// URL")


class RedisSessionStore:
    """Sessions in Redis (layout in the module docstring): any gateway process sharing the store serves them."""

    def __init__(
        self,
        url: str | None = None,
        *,
        client: Any = None,
        prefix: str = "slime:agent:",
        lock_ttl_ms: int = 10_000,  # a dead process's lock stalls its session this long; commits are fenced
        lock_timeout_s: float = 60.0,
        session_ttl_s: int = 24 * 3600,
        tombstone_ttl_s: int = 3600,
        result_ttl_s: int = 600,
    ) -> None:
        if client is None:
            import redis.asyncio as aioredis

            if url is None:
                raise ValueError("RedisSessionStore needs a redis:// URL or a client")
            client = aioredis.Redis.from_url(url, decode_responses=True)
        self.r = client
        self.prefix = prefix
        self.lock_ttl_ms = lock_ttl_ms
        self.lock_timeout_s = lock_timeout_s
        self.session_ttl_s = session_ttl_s
        self.tombstone_ttl_s = tombstone_ttl_s
        self.result_ttl_s = result_ttl_s

    def _k(self, sid: str, part: str = "") -> str:
        return f"{self.prefix}s:{sid}{part}"

    def _key_index(self, api_key: str) -> str:
        return f"{self.prefix}k:{api_key}"

    # ---- SessionStore ----------------------------------------------------------------------------------
    async def create(
        self, *, sampling_defaults: dict[str, Any], max_context_tokens: int, metadata: dict[str, Any]
    ) -> Session:
        sid, key = new_credentials()
        s = Session(sid, key, dict(sampling_defaults), int(max_context_tokens), dict(metadata))
        meta = {
            "api_key": key,
            "sampling_defaults": s.sampling_defaults,
            "max_context_tokens": s.max_context_tokens,
            "metadata": s.metadata,
            "created": s.created,
        }
        with _reachable():
            async with self.r.pipeline(transaction=True) as pipe:
                pipe.hset(self._k(sid), mapping={"meta": json.dumps(meta), "state": json.dumps(state_to_json(s))})
                pipe.expire(self._k(sid), self.session_ttl_s)
                pipe.set(self._key_index(key), sid, ex=self.session_ttl_s)
                await pipe.execute()
        return s

    async def get(self, session_id: str) -> Session | None:
        with _reachable():
            meta, state = await self.r.hmget(self._k(session_id), ["meta", "state"])
        if meta is None or state is None:
            return None
        m = json.loads(meta)
        s = Session(
            session_id,
            m["api_key"],
            m["sampling_defaults"],
            int(m["max_context_tokens"]),
            m["metadata"],
            float(m["created"]),
        )
        load_state(s, json.loads(state))
        return s

    async def by_api_key(self, api_key: str) -> Session | None:
        with _reachable():
            sid = await self.r.get(self._key_index(api_key))
        return await self.get(sid) if sid is not None else None

    @contextlib.asynccontextmanager
    async def locked(self, session_id: str) -> AsyncIterator[Session]:
        with _reachable():
            token = await self._acquire(session_id)
        done = False
        try:
            s = await self.get(session_id)
            if s is None:
                raise KeyError(session_id)
            with _reachable():
                await self._load_newest_turns(s)
            yield s
            with _reachable():
                await self._commit(s, token)
            done = True
        finally:
            if not done:
                with contextlib.suppress(StoreError), _reachable():  # unreleased, the lock expires by itself
                    await self._release(session_id, token)

    async def load_turns(self, session: Session) -> None:
        with _reachable():
            raw = await self.r.lrange(self._k(session.session_id, ":turns"), 0, -1)
        if len(raw) != session.num_turns:
            raise StoreError(f"session {session.session_id}: {len(raw)} turn records, state says {session.num_turns}")
        session.turns = {i: turn_from_json(json.loads(x)) for i, x in enumerate(raw)}

    async def remove(self, session_id: str, result: list[dict[str, Any]]) -> None:
        """Drop the chains and turn log and keep `result`, in one transaction; the flags stay as a
        short-lived tombstone (late requests get 409)."""
        async with self.locked(session_id) as s:
            s.chains, s.frozen, s.pending, s.inflight = {}, [], {}, []
            s.result = result

    async def result(self, session_id: str) -> list[dict[str, Any]] | None:
        with _reachable():
            raw = await self.r.get(self._k(session_id, ":result"))
        return json.loads(raw) if raw is not None else None

    async def close(self) -> None:
        await self.r.aclose()

    # ---- lock and fenced commit ------------------------------------------------------------------------
    async def _acquire(self, sid: str) -> str:
        token = secrets.token_hex(8)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.lock_timeout_s
        delay = 0.001
        while not await self.r.set(self._k(sid, ":lock"), token, nx=True, px=self.lock_ttl_ms):
            if loop.time() > deadline:
                raise StoreError(f"session {sid}: lock not acquired within {self.lock_timeout_s:.0f}s")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.02)
        return token

    async def _release(self, sid: str, token: str) -> None:
        from redis.exceptions import WatchError

        lock = self._k(sid, ":lock")
        with contextlib.suppress(WatchError):
            async with self.r.pipeline(transaction=True) as pipe:
                await pipe.watch(lock)
                if await pipe.get(lock) == token:
                    pipe.multi()
                    pipe.delete(lock)
                    await pipe.execute()

    async def _commit(self, s: Session, token: str) -> None:
        """State + new turns (or, once finished, the result in place of the turn log) + unlock in one
        transaction, only while we still hold the lock."""
        from redis.exceptions import WatchError

        lock, turns = self._k(s.session_id, ":lock"), self._k(s.session_id, ":turns")
        drop_turns = s.result is not None
        ttl = self.tombstone_ttl_s if drop_turns else self.session_ttl_s
        try:
            async with self.r.pipeline(transaction=True) as pipe:
                await pipe.watch(lock)
                if await pipe.get(lock) != token:
                    raise StoreError(f"session {s.session_id}: lock expired before the commit (nothing written)")
                pipe.multi()
                pipe.hset(self._k(s.session_id), "state", json.dumps(state_to_json(s)))
                if drop_turns:
                    pipe.delete(turns)
                    pipe.set(self._k(s.session_id, ":result"), json.dumps(s.result), ex=self.result_ttl_s)
                elif s.new_turns:
                    pipe.rpush(turns, *(json.dumps(turn_to_json(s.turns[i])) for i in s.new_turns))
                    pipe.expire(turns, ttl)
                pipe.expire(self._k(s.session_id), ttl)
                pipe.expire(self._key_index(s.api_key), ttl)
                pipe.delete(lock)
                await pipe.execute()
        except WatchError as e:
            raise StoreError(f"session {s.session_id}: lock lost during the commit (nothing written)") from e
        s.new_turns.clear()

    async def _load_newest_turns(self, s: Session) -> None:
        ids = [ch.turn_ids[-1] for ch in s.chains.values() if ch.turn_ids]
        if not ids:
            return
        async with self.r.pipeline(transaction=False) as pipe:
            for i in ids:
                pipe.lindex(self._k(s.session_id, ":turns"), i)
            raw = await pipe.execute()
        for i, x in zip(ids, raw, strict=True):
            if x is None:
                raise StoreError(f"session {s.session_id}: turn {i} missing from the turn log")
            s.turns[i] = turn_from_json(json.loads(x))
