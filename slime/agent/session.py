"""A gateway session: one agent episode, with its credential, sampling defaults and conversation chains.

An episode may hold several conversations (chains): the main agent's, one per sub-agent, and the calls made
to a small/fast model. `slime.agent.chains` decides which chain a request belongs to and
`slime.agent.prompts` builds each request's prompt ids against its chain; this module only holds the state
they work on, plus its JSON wire form, so a store shared by several gateway processes
(`slime.agent.stores`) can keep it.

Segment kinds, in the order `Session.segments()` returns them (frozen contexts in freeze order, then the live
chains, the main one last): `wipe` (a context whose history the client rewrote), `subagent` (a sub-agent's
conversation), `auxiliary` (small/fast-model calls: served but never trained, so their loss mask is all 0),
`final` (the main chain's last context). All belong to one trajectory: one group id when fanned out.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

from slime.agent.trajectory import TokenSegment, TurnRecord, merge_turns

MAIN = "main"
MAIN_KIND, SUBAGENT_KIND, AUX_KIND = "main", "subagent", "auxiliary"
# segment kind of a chain still live when the session finishes, by chain kind
_LIVE_SEGMENT_KIND = {MAIN_KIND: "final", SUBAGENT_KIND: "subagent", AUX_KIND: "auxiliary"}


@dataclass
class ChainTurn:
    record: TurnRecord
    hashes: list[str]
    tools_hash: str
    prompt_text: str  # the request rendered with the generation prompt (for the re-render path)
    response: dict[str, Any]  # canonical form of what we answered (`slime.agent.prompts.canonical_assistant`)
    rid: str = ""  # the engine request id: a retried request is answered from this turn under the same ids


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
    result: list[dict[str, Any]] | None = field(default=None, repr=False)  # set by `SessionStore.remove` only

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
        """What the admin API shows of a session: never its credential."""
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
        "rid": t.rid,
    }


def turn_from_json(d: dict[str, Any]) -> ChainTurn:
    rec = TurnRecord(d["prompt_ids"], d["output_ids"], d["log_probs"], d["finish_reason"])
    return ChainTurn(rec, d["hashes"], d["tools_hash"], d["prompt_text"], d["response"], d.get("rid", ""))
