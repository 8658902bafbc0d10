"""RedisSessionStore on fakeredis: two store instances on one fake server stand for two gateway processes.
Sessions, turn records and the lock are shared; commits are fenced by the lock token; finished sessions
leave a tombstone."""

from __future__ import annotations

import asyncio
import json

import pytest

from slime.agent.session import MAIN, ChainTurn
from slime.agent.stores import InMemorySessionStore, RedisSessionStore, StoreError, open_store
from slime.agent.trajectory import TurnRecord
from slime.utils.async_utils import run

# GPU hosts run `pytest -m gpu tests` without the agent extras: skip this module there, do not fail collection
fakeredis = pytest.importorskip("fakeredis")

pytestmark = pytest.mark.cpu


def stores(n: int = 2, **kw) -> list[RedisSessionStore]:
    server = fakeredis.FakeServer()
    return [
        RedisSessionStore(client=fakeredis.FakeAsyncRedis(server=server, decode_responses=True), **kw)
        for _ in range(n)
    ]


def turn(i: int) -> ChainTurn:
    """Turn i's prompt = turn i-1's prompt + output + one tool-result token: one mergeable chain."""
    prompt = [1, 2]
    for j in range(i):
        prompt = prompt + [10 + j, 11 + j, 50 + j]
    rec = TurnRecord(prompt, [10 + i, 11 + i], [-0.1, -0.2], "stop")
    return ChainTurn(rec, [f"h{j}" for j in range(i + 1)], "th", f"text{i}", {"content": f"c{i}", "tool_calls": []})


def test_session_state_and_turns_are_shared_between_processes() -> None:
    async def main() -> None:
        a, b = stores()
        s = await a.create(sampling_defaults={"temperature": 0.7}, max_context_tokens=99, metadata={"index": 3})
        got = await b.by_api_key(s.api_key)
        assert got is not None and got.session_id == s.session_id
        assert (got.sampling_defaults, got.max_context_tokens, got.metadata) == (
            {"temperature": 0.7},
            99,
            {"index": 3},
        )
        for i in range(4):
            store = (a, b)[i % 2]  # turns alternate between the processes
            async with store.locked(s.session_id) as st:
                if i:
                    assert st.last_turn(MAIN) == turn(i - 1)  # the other process's turn, loaded for routing
                st.num_requests += 1
                st.add_turn(MAIN, turn(i))
        async with a.locked(s.session_id) as st:
            assert st.num_requests == 4 and st.chains[MAIN].turn_ids == [0, 1, 2, 3]
            await a.load_turns(st)
            assert [st.turns[i] for i in range(4)] == [turn(i) for i in range(4)]
            (seg,) = st.segments()
            assert seg.metadata["num_turns"] == 4
        assert await a.get("sess-unknown") is None and await b.by_api_key("nope") is None
        await a.close()
        await b.close()

    run(main())


def test_lock_serialises_processes_no_update_lost() -> None:
    async def main() -> None:
        a, b = stores()
        s = await a.create(sampling_defaults={}, max_context_tokens=0, metadata={})

        async def bump(store: RedisSessionStore) -> None:
            async with store.locked(s.session_id) as st:
                n = st.num_requests
                await asyncio.sleep(0)  # let the other process try to get in
                st.num_requests = n + 1
                st.inflight.append(f"r{n}")

        await asyncio.gather(*(bump((a, b)[i % 2]) for i in range(40)))
        snap = await b.get(s.session_id)
        assert snap.num_requests == 40 and snap.inflight == [f"r{i}" for i in range(40)]
        await a.close()
        await b.close()

    run(main())


def test_commit_after_lock_expiry_writes_nothing() -> None:
    async def main() -> None:
        a, b = stores(lock_ttl_ms=50, lock_timeout_s=5)
        s = await a.create(sampling_defaults={}, max_context_tokens=0, metadata={})
        with pytest.raises(StoreError, match="lock"):
            async with a.locked(s.session_id) as st:
                st.add_turn(MAIN, turn(0))
                await asyncio.sleep(0.2)  # the lock expires; another process takes it and commits
                async with b.locked(s.session_id) as other:
                    other.num_requests = 7
        snap = await a.get(s.session_id)
        assert snap.num_requests == 7 and snap.num_turns == 0
        assert await a.r.llen(a._k(s.session_id, ":turns")) == 0
        await a.close()
        await b.close()

    run(main())


def test_failed_block_releases_the_lock_and_discards_changes() -> None:
    async def main() -> None:
        (a,) = stores(1, lock_timeout_s=2)
        s = await a.create(sampling_defaults={}, max_context_tokens=0, metadata={})
        with pytest.raises(RuntimeError):
            async with a.locked(s.session_id) as st:
                st.num_requests = 5
                raise RuntimeError("boom")
        async with a.locked(s.session_id) as st:  # not stuck
            assert st.num_requests == 0
        with pytest.raises(KeyError):
            async with a.locked("sess-missing"):
                pass
        await a.close()

    run(main())


def test_remove_leaves_a_tombstone() -> None:
    async def main() -> None:
        a, b = stores()
        s = await a.create(sampling_defaults={}, max_context_tokens=0, metadata={})
        async with a.locked(s.session_id) as st:
            st.add_turn(MAIN, turn(0))
            st.finished = st.sealed = True
        await b.remove(s.session_id, [{"tokens": [1]}])
        tomb = await a.by_api_key(s.api_key)
        assert tomb.finished and tomb.sealed and tomb.chains == {} and tomb.num_turns == 1
        assert await a.r.exists(a._k(s.session_id, ":turns")) == 0
        assert await a.result(s.session_id) == [{"tokens": [1]}]  # what finish returned, for a retried finish
        assert 0 < await a.r.ttl(a._k(s.session_id, ":result")) <= a.result_ttl_s
        assert 0 < await a.r.ttl(a._k(s.session_id)) <= a.tombstone_ttl_s
        state = json.loads(await a.r.hget(a._k(s.session_id), "state"))
        assert state["inflight"] == [] and state["pending"] == {}
        await a.close()
        await b.close()

    run(main())


def test_unreachable_redis_is_a_store_error() -> None:
    """A restarting Redis must reach clients as 503 (retryable), never as the gateway's own 500."""
    server = fakeredis.FakeServer()
    store = RedisSessionStore(client=fakeredis.FakeAsyncRedis(server=server, decode_responses=True))

    async def main() -> None:
        s = await store.create(sampling_defaults={}, max_context_tokens=0, metadata={})
        server.connected = False
        for call in (store.get(s.session_id), store.by_api_key(s.api_key), store.result(s.session_id)):
            with pytest.raises(StoreError, match="unavailable"):
                await call
        with pytest.raises(StoreError, match="unavailable"):
            async with store.locked(s.session_id):
                pass
        server.connected = True
        assert (await store.get(s.session_id)).session_id == s.session_id
        await store.close()

    run(main())


def test_memory_store_keeps_results_for_a_while() -> None:
    async def main() -> None:
        store = InMemorySessionStore(result_ttl_s=0.0)
        a = await store.create(sampling_defaults={}, max_context_tokens=0, metadata={})
        await store.remove(a.session_id, [{"tokens": [1]}])
        assert await store.result(a.session_id) == [{"tokens": [1]}]
        b = await store.create(sampling_defaults={}, max_context_tokens=0, metadata={})
        await store.remove(b.session_id, [])  # expires what is older than its TTL
        assert await store.result(a.session_id) is None and await store.result(b.session_id) == []

    run(main())


def test_open_store_by_url() -> None:
    assert isinstance(open_store(None), InMemorySessionStore)
    assert isinstance(open_store("memory"), InMemorySessionStore)
    assert isinstance(open_store("redis://127.0.0.1:1/0"), RedisSessionStore)
    with pytest.raises(ValueError, match="agent-store"):
        open_store("postgres://x")
