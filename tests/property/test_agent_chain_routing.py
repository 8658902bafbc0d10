"""Random Claude-Code-shaped episodes (main turns, `Agent` calls, sub-agent turns, their tool results,
small/fast-model calls, compactions), replayed through chain routing on the in-memory store and on the Redis
store (fakeredis, turns alternating between two store instances as between two gateway processes):

* every recorded turn lands in exactly one segment group, and only with turns of its own conversation;
* a sub-agent's turns form `subagent` groups, auxiliary calls `auxiliary` groups, compactions `wipe` groups;
* both stores end in the same state and produce the same segments.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slime.agent.chains import RequestHints, register_subagent_calls, route
from slime.agent.parsing import ParsedOutput, ToolCall
from slime.agent.session import ChainTurn, state_to_json
from slime.agent.stores import InMemorySessionStore, RedisSessionStore, SessionStore
from slime.agent.trajectory import TurnRecord
from slime.utils.async_utils import run

# GPU hosts run `pytest -m gpu tests` without the agent extras: skip this module there, do not fail collection
fakeredis = pytest.importorskip("fakeredis")

pytestmark = pytest.mark.cpu

AUX = "small-fast"
events = st.lists(
    st.one_of(
        st.just(("main",)),
        st.just(("spawn",)),
        st.tuples(st.just("sub"), st.integers(0, 3)),
        st.tuples(st.just("close"), st.integers(0, 3)),
        st.just(("aux",)),
        st.just(("compact",)),
    ),
    min_size=1,
    max_size=25,
)


class Episode:
    """The client side: each conversation's message list (as hash strings) and which call opened which sub-agent."""

    def __init__(self) -> None:
        self.main = ["sys", "task"]
        self.subs: dict[int, list[str]] = {}
        self.calls: dict[int, str] = {}  # sub-agent number -> our tool-call id
        self.aux: list[str] = ["aux-sys"]
        self.n = 0
        self.owner: dict[int, str] = {}  # turn id -> conversation ("main", "sub<k>", "aux")


async def step(store: SessionStore, sid: str, ep: Episode, ev: tuple[Any, ...]) -> None:
    ep.n += 1
    kind = ev[0]
    results: tuple[str, ...] = ()
    if kind == "close" and ev[1] in ep.calls:
        results = (ep.calls.pop(ev[1]),)
        kind = "main"
    if kind == "compact":
        ep.main = ["sys", f"summary{ep.n}"]
        kind = "main"
    if kind in ("main", "spawn"):
        msgs, hints, conv = ep.main, RequestHints(is_subagent=False, tool_result_ids=results), "main"
    elif kind == "sub" and ev[1] in ep.subs:
        msgs, hints, conv = (
            ep.subs[ev[1]],
            RequestHints(is_subagent=True, first_user_texts=(f"job{ev[1]}",)),
            f"sub{ev[1]}",
        )
    elif kind == "aux":
        msgs, hints, conv = ep.aux, RequestHints(model=AUX), "aux"
    else:
        return
    rid = f"{sid}-x{ep.n}"
    async with store.locked(sid) as s:
        cid = route(s, hints, list(msgs), {AUX})
        last = s.last_turn(cid)
        if last is not None and not (len(msgs) > len(last.hashes) and msgs[: len(last.hashes)] == last.hashes):
            s.freeze(cid, s.wipe_kind(cid))  # what the prompt plan decides for a rewritten history
        rec = TurnRecord([ep.n, *range(len(msgs))], [1000 + ep.n], [-0.5], "stop")
        tid = s.add_turn(cid, ChainTurn(rec, list(msgs), "th", "", {"content": "", "tool_calls": []}))
        ep.owner[tid] = conv
        if kind == "spawn":
            k = len(ep.subs)
            if k < 4:
                register_subagent_calls(
                    s, cid, rid, ParsedOutput(None, "", [ToolCall("Agent", {"prompt": f"job{k}"})])
                )
                ep.subs[k] = ["subsys", f"job{k}"]
                ep.calls[k] = f"toolu_{rid}_0"
    msgs += [f"answer{ep.n}", f"result{ep.n}"]


async def play(stores: list[SessionStore], evs: list[tuple[Any, ...]]) -> tuple[dict[str, Any], list[Any], Episode]:
    s0 = await stores[0].create(sampling_defaults={}, max_context_tokens=0, metadata={})
    ep = Episode()
    for i, ev in enumerate(evs):
        await step(stores[i % len(stores)], s0.session_id, ep, ev)
    async with stores[-1].locked(s0.session_id) as s:
        await stores[-1].load_turns(s)
        state = state_to_json(s)
        groups = list(s.frozen) + [(ch.kind, cid, ch.turn_ids) for cid, ch in s.chains.items()]
        segs = [(dict(g.metadata), g.prompt_ids, g.response_ids, g.loss_mask) for g in s.segments()]
    # session ids are random: compare the two stores modulo the id
    state, segs = (json.loads(json.dumps(x).replace(s0.session_id, "SID")) for x in (state, segs))
    return state, [groups, segs], ep


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(events)
def test_routing_partitions_turns_and_stores_agree(evs: list[tuple[Any, ...]]) -> None:
    server = fakeredis.FakeServer()
    redis = [
        RedisSessionStore(client=fakeredis.FakeAsyncRedis(server=server, decode_responses=True)) for _ in range(2)
    ]
    mem_state, (groups, mem_segs), ep = run(play([InMemorySessionStore()], evs))
    red_state, (_, red_segs), _ = run(play(redis, evs))
    for r in redis:
        run(r.close())
    assert mem_state == red_state and mem_segs == red_segs

    seen: list[int] = []
    for kind, cid, ids in groups:
        convs = {ep.owner[i] for i in ids}
        assert len(convs) <= 1, (cid, convs)  # a group never mixes conversations
        seen += ids
        for conv in convs:
            if conv == "aux":
                assert cid == "aux" and kind == "auxiliary"
            elif conv.startswith("sub"):
                assert cid.startswith("sub:") and kind in ("subagent", "wipe")
            else:
                assert cid == "main" and kind in ("main", "wipe")
    assert sorted(seen) == sorted(ep.owner)  # every turn exactly once
    for meta, _, _, mask in mem_segs:
        assert (sum(mask) == 0) == (meta["segment_kind"] == "auxiliary")
