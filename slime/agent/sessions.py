"""Gateway sessions: one agent episode each, with its credential, sampling defaults and conversation chains.

An episode may hold several conversations (chains): the main agent's, one per sub-agent, and the calls made
to a small/fast model. `slime.agent.chains` decides which chain a request belongs to. Within a chain the
prompt token ids are built per request (spec §8.3 new / append / wipe):

* **append**: the request repeats the chain's previous request (by message hash) and then the assistant
  message this gateway answered. The prompt is then the previous prompt ids + the exact sampled ids + the
  template's rendering of what follows, so the model sees its own tokens and merging never drifts ("token in,
  token out"). If the client changed that assistant message, the history is re-rendered after the previous
  prompt and `merge_turns` masks whatever no longer matches.
* **wipe**: anything else (history rewritten, e.g. compaction, or a retried request) freezes the chain's turns
  as their own segment and starts the chain again.

Segment kinds, in the order `segments()` returns them (frozen contexts in freeze order, then the live chains,
the main one last): `wipe` (a context whose history the client rewrote), `subagent` (a sub-agent's
conversation), `auxiliary` (small/fast-model calls: served but never trained, so their loss mask is all 0),
`final` (the main chain's last context). All belong to one trajectory: one group id when fanned out.

Chains, turn records and the per-session lock live in a `SessionStore`: `InMemorySessionStore` for one gateway
process, `slime.agent.redis_store.RedisSessionStore` when several processes serve one session. Every change
happens inside `store.locked(session_id)`, which yields the current state and persists it on exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from slime.agent.messages import message_hash, tools_hash
from slime.agent.parsing import ParsedOutput
from slime.agent.trajectory import TokenSegment, TurnRecord, merge_turns

logger = logging.getLogger(__name__)

MAIN = "main"
MAIN_KIND, SUBAGENT_KIND, AUX_KIND = "main", "subagent", "auxiliary"
# segment kind of a chain still live when the session finishes, by chain kind
_LIVE_SEGMENT_KIND = {MAIN_KIND: "final", SUBAGENT_KIND: "subagent", AUX_KIND: "auxiliary"}


class StoreError(Exception):
    """The session store failed (lock not acquired, lock lost, records missing): the gateway answers 503."""

    status = 503


@dataclass
class ChainTurn:
    record: TurnRecord
    hashes: list[str]
    tools_hash: str
    prompt_text: str  # the request rendered with the generation prompt (for the re-render path)
    response: dict[str, Any]  # canonical form of what we answered (see `canonical_assistant`)


@dataclass
class Chain:
    kind: str  # main | subagent | auxiliary
    turn_ids: list[int] = field(default_factory=list)
    prompt: str | None = None  # a sub-agent's task prompt: how its requests are recognised


@dataclass
class Session:
    session_id: str
    api_key: str
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    max_context_tokens: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)
    created: float = field(default_factory=time.time)
    finished: bool = False  # finish started: new requests get 409
    sealed: bool = False  # segments taken: a late answer is not recorded
    num_requests: int = 0
    chains: dict[str, Chain] = field(default_factory=dict)
    frozen: list[tuple[str, str, list[int]]] = field(default_factory=list)  # (segment kind, chain id, turn ids)
    # Agent/Task calls whose sub-agent has not spoken yet: call key -> [task prompt, parent chain id]
    pending: dict[str, list[str]] = field(default_factory=dict)
    inflight: list[str] = field(default_factory=list)  # engine request ids between plan and commit
    num_turns: int = 0
    seq: int = 0
    # turn log entries loaded in this process (a Redis-backed session loads only what routing needs)
    turns: dict[int, ChainTurn] = field(default_factory=dict, repr=False)
    new_turns: list[int] = field(default_factory=list, repr=False)  # appended since loaded: the store persists them

    @property
    def chain(self) -> list[ChainTurn]:
        """The main chain's live turns (read-only view)."""
        ch = self.chains.get(MAIN)
        return [self.turns[i] for i in ch.turn_ids] if ch is not None else []

    def open_chain(self, chain_id: str, kind: str, prompt: str | None = None) -> Chain:
        ch = self.chains.get(chain_id)
        if ch is None:
            ch = self.chains[chain_id] = Chain(kind, [], prompt)
        return ch

    def last_turn(self, chain_id: str) -> ChainTurn | None:
        ch = self.chains.get(chain_id)
        if ch is None or not ch.turn_ids:
            return None
        return self.turns[ch.turn_ids[-1]]

    def add_turn(self, chain_id: str, turn: ChainTurn) -> int:
        ch = self.open_chain(chain_id, MAIN_KIND)
        tid = self.num_turns
        self.num_turns += 1
        self.turns[tid] = turn
        self.new_turns.append(tid)
        ch.turn_ids.append(tid)
        return tid

    def freeze(self, chain_id: str, kind: str, *, close: bool = False) -> None:
        """Freeze the chain's turns as one segment group of `kind`; the chain restarts empty (or is closed)."""
        ch = self.chains.get(chain_id)
        if ch is None:
            return
        if ch.turn_ids:
            self.frozen.append((kind, chain_id, list(ch.turn_ids)))
        ch.turn_ids = []
        if close:
            del self.chains[chain_id]

    def wipe_kind(self, chain_id: str) -> str:
        ch = self.chains.get(chain_id)
        return AUX_KIND if ch is not None and ch.kind == AUX_KIND else "wipe"

    def segments(self) -> list[TokenSegment]:
        """Merged token segments of every frozen context plus the live chains (empty segments dropped).
        Needs every turn loaded (`SessionStore.load_turns`)."""
        live = [(cid, ch) for cid, ch in self.chains.items() if cid != MAIN] + (
            [(MAIN, self.chains[MAIN])] if MAIN in self.chains else []
        )
        groups = list(self.frozen) + [(_LIVE_SEGMENT_KIND[ch.kind], cid, ch.turn_ids) for cid, ch in live]
        out: list[TokenSegment] = []
        for kind, cid, ids in groups:
            if not ids:
                continue
            for seg in merge_turns([self.turns[i].record for i in ids], kind=kind, metadata={"chain": cid}):
                if not seg.response_ids:
                    continue
                if kind == AUX_KIND:  # served, never trained
                    n = len(seg.response_ids)
                    seg = replace(seg, loss_mask=[0] * n, rollout_log_probs=[0.0] * n)
                out.append(seg)
        return out

    def info(self) -> dict[str, Any]:
        return {
            "session_id": self.session_id,
            "finished": self.finished,
            "num_requests": self.num_requests,
            "num_turns": self.num_turns,
            "num_chains": len(self.frozen) + sum(1 for ch in self.chains.values() if ch.turn_ids),
            "sampling_defaults": self.sampling_defaults,
            "max_context_tokens": self.max_context_tokens,
            "metadata": self.metadata,
        }


# ---- wire forms (what a shared store keeps) --------------------------------------------------------------


def state_to_json(s: Session) -> dict[str, Any]:
    """The mutable routing state (small); turn records are stored separately, append-only."""
    return {
        "finished": s.finished,
        "sealed": s.sealed,
        "num_requests": s.num_requests,
        "chains": {cid: [ch.kind, ch.turn_ids, ch.prompt] for cid, ch in s.chains.items()},
        "frozen": [list(f) for f in s.frozen],
        "pending": s.pending,
        "inflight": s.inflight,
        "num_turns": s.num_turns,
        "seq": s.seq,
    }


def load_state(s: Session, d: dict[str, Any]) -> None:
    s.finished, s.sealed = bool(d["finished"]), bool(d["sealed"])
    s.num_requests, s.num_turns, s.seq = int(d["num_requests"]), int(d["num_turns"]), int(d["seq"])
    s.chains = {cid: Chain(kind, list(ids), prompt) for cid, (kind, ids, prompt) in d["chains"].items()}
    s.frozen = [(kind, cid, list(ids)) for kind, cid, ids in d["frozen"]]
    s.pending = {k: list(v) for k, v in d["pending"].items()}
    s.inflight = list(d["inflight"])


def turn_to_json(t: ChainTurn) -> dict[str, Any]:
    r = t.record
    return {
        "prompt_ids": r.prompt_ids,
        "output_ids": r.output_ids,
        "log_probs": r.output_log_probs,
        "finish_reason": r.finish_reason,
        "hashes": t.hashes,
        "tools_hash": t.tools_hash,
        "prompt_text": t.prompt_text,
        "response": t.response,
    }


def turn_from_json(d: dict[str, Any]) -> ChainTurn:
    rec = TurnRecord(d["prompt_ids"], d["output_ids"], d["log_probs"], d["finish_reason"])
    return ChainTurn(rec, d["hashes"], d["tools_hash"], d["prompt_text"], d["response"])


# ---- stores --------------------------------------------------------------------------------------------


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

    async def remove(self, session_id: str) -> None:
        """Drop the session's data; keep a tombstone so late requests get 409."""
        ...

    async def close(self) -> None: ...


def new_credentials() -> tuple[str, str]:
    return f"sess-{secrets.token_hex(8)}", f"sk-slime-{secrets.token_urlsafe(24)}"


class InMemorySessionStore:
    """Sessions of one gateway process. Finished sessions stay as tombstones so late requests get 409."""

    def __init__(self) -> None:
        self._by_id: dict[str, Session] = {}
        self._by_key: dict[str, str] = {}
        self._locks: dict[str, asyncio.Lock] = {}

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

    async def remove(self, session_id: str) -> None:
        s = self._by_id.get(session_id)
        if s is not None:  # drop the data, keep the tombstone
            s.chains, s.frozen, s.pending, s.turns = {}, [], {}, {}

    async def close(self) -> None:
        return None


def open_store(url: str | None) -> SessionStore:
    """`--agent-store`: unset or `memory` -> in-process; `redis://...` (or `rediss://`) -> Redis."""
    if not url or url == "memory":
        return InMemorySessionStore()
    if url.startswith(("redis://", "rediss://", "unix://")):
        from slime.agent.redis_store import RedisSessionStore

        return RedisSessionStore(url)
    raise ValueError(f"--agent-store {url!r}: use 'memory' or a redis:// URL")


# ---- prompt building -----------------------------------------------------------------------------------


def canonical_assistant(msg: dict[str, Any]) -> dict[str, Any]:
    """What must be equal for a client's assistant message to count as the one we answered. Reasoning is
    left out: most clients do not send it back. Lists, not tuples, so it survives a JSON round trip."""
    calls = [[c["function"]["name"], c["function"]["arguments"]] for c in msg.get("tool_calls") or []]
    return {"content": (msg.get("content") or "").strip(), "tool_calls": calls}


def parsed_to_message(parsed: ParsedOutput) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": parsed.text}
    if parsed.tool_calls:
        msg["tool_calls"] = [
            {"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in parsed.tool_calls
        ]
    return msg


class PromptBuilder:
    """Renders template messages to prompt ids against a conversation chain (pure apart from the tokenizer)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        self.eos_text = tokenizer.eos_token
        self.eos_id = tokenizer.eos_token_id

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], gen: bool) -> str:
        return self.tok.apply_chat_template(messages, tools=tools or None, tokenize=False, add_generation_prompt=gen)

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def plan(
        self,
        last: ChainTurn | None,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]],
        hashes: list[str] | None = None,
    ) -> tuple[str, list[int], list[str], str, str]:
        """Prompt ids for a request continuing the chain whose newest turn is `last`.

        Returns (action, prompt_ids, hashes, tools_hash, prompt_text); action is new | append |
        append_rerendered | wipe (the caller freezes the chain on wipe)."""
        hashes = hashes if hashes is not None else [message_hash(m) for m in messages]
        th = tools_hash(tools)
        full = self.render(messages, tools, gen=True)
        if last is None:
            return "new", self.encode(full), hashes, th, full
        k = len(last.hashes)
        if th == last.tools_hash and len(hashes) > k and hashes[:k] == last.hashes:
            ids = self._reuse_tokens(last, messages, tools, full, k)
            if ids is not None:
                return "append", ids, hashes, th, full
            if full.startswith(last.prompt_text):
                ids = last.record.prompt_ids + self.encode(full[len(last.prompt_text) :])
                return "append_rerendered", ids, hashes, th, full
        return "wipe", self.encode(full), hashes, th, full

    def _reuse_tokens(
        self, last: ChainTurn, messages: list[dict[str, Any]], tools: list[dict[str, Any]], full: str, k: int
    ) -> list[int] | None:
        nxt = messages[k]
        if len(messages) <= k + 1 or nxt["role"] != "assistant":
            return None
        if canonical_assistant(nxt) != last.response:
            return None
        upto = self.render(messages[: k + 1], tools, gen=False)
        end = upto.rfind(self.eos_text) if self.eos_text else -1
        if not full.startswith(upto) or end < 0:
            return None
        suffix = upto[end + len(self.eos_text) :] + full[len(upto) :]
        out = last.record.output_ids
        if not out or out[-1] != self.eos_id:  # cut by length: the template closes the turn itself
            suffix = self.eos_text + suffix
        return last.record.prompt_ids + list(out) + self.encode(suffix)
