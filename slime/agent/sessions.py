"""Gateway sessions: one agent episode each, with its credential, sampling defaults and conversation chain.

The chain decides, per request, how the prompt token ids are built (spec §8.3 new / append / wipe):

* **append**: the request repeats the previous request's messages (by hash) and then the assistant message
  this gateway answered. The prompt is then the previous prompt ids + the exact sampled ids + the template's
  rendering of what follows, so the model sees its own tokens and merging never drifts ("token in, token
  out"). If the client changed that assistant message, the history is re-rendered after the previous prompt
  and `merge_turns` masks whatever no longer matches.
* **wipe**: anything else (history rewritten, e.g. compaction, or a retried request) freezes the chain as its
  own segment and starts a new one.

`SessionStore` is the seam for several gateway processes (a Redis store implements it in part 2).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from slime.agent.messages import message_hash, tools_hash
from slime.agent.parsing import ParsedOutput
from slime.agent.trajectory import TokenSegment, TurnRecord, merge_turns

logger = logging.getLogger(__name__)


@dataclass
class ChainTurn:
    record: TurnRecord
    hashes: list[str]
    tools_hash: str
    prompt_text: str  # the request rendered with the generation prompt (for the re-render path)
    response: dict[str, Any]  # canonical form of what we answered (see `canonical_assistant`)


@dataclass
class Session:
    session_id: str
    api_key: str
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    max_context_tokens: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)
    created: float = field(default_factory=time.time)
    finished: bool = False
    chain: list[ChainTurn] = field(default_factory=list)
    frozen: list[tuple[str, list[TurnRecord]]] = field(default_factory=list)
    num_requests: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)
    inflight: set[asyncio.Task] = field(default_factory=set, repr=False)

    def freeze_chain(self, kind: str) -> None:
        if self.chain:
            self.frozen.append((kind, [t.record for t in self.chain]))
            self.chain = []

    def segments(self) -> list[TokenSegment]:
        """Merged token segments of every frozen chain plus the live one (empty segments dropped)."""
        chains = self.frozen + ([("final", [t.record for t in self.chain])] if self.chain else [])
        out = []
        for kind, turns in chains:
            out += [s for s in merge_turns(turns, kind=kind) if s.response_ids]
        return out

    def info(self) -> dict[str, Any]:
        return {
            "session_id": self.session_id,
            "finished": self.finished,
            "num_requests": self.num_requests,
            "num_turns": len(self.chain) + sum(len(t) for _, t in self.frozen),
            "num_chains": len(self.frozen) + (1 if self.chain else 0),
            "sampling_defaults": self.sampling_defaults,
            "max_context_tokens": self.max_context_tokens,
            "metadata": self.metadata,
        }


class SessionStore(Protocol):
    async def create(
        self, *, sampling_defaults: dict[str, Any], max_context_tokens: int, metadata: dict[str, Any]
    ) -> Session: ...

    async def get(self, session_id: str) -> Session | None: ...

    async def by_api_key(self, api_key: str) -> Session | None: ...

    async def remove(self, session_id: str) -> None: ...


class InMemorySessionStore:
    """Sessions of one gateway process. Finished sessions stay as tombstones so late requests get 409."""

    def __init__(self) -> None:
        self._by_id: dict[str, Session] = {}
        self._by_key: dict[str, str] = {}

    async def create(
        self, *, sampling_defaults: dict[str, Any], max_context_tokens: int, metadata: dict[str, Any]
    ) -> Session:
        sid = f"sess-{secrets.token_hex(8)}"
        s = Session(sid, f"sk-slime-{secrets.token_urlsafe(24)}", dict(sampling_defaults), int(max_context_tokens))
        s.metadata = dict(metadata)
        self._by_id[sid] = s
        self._by_key[s.api_key] = sid
        return s

    async def get(self, session_id: str) -> Session | None:
        return self._by_id.get(session_id)

    async def by_api_key(self, api_key: str) -> Session | None:
        sid = self._by_key.get(api_key)
        return self._by_id.get(sid) if sid is not None else None

    async def remove(self, session_id: str) -> None:
        s = self._by_id.get(session_id)
        if s is not None:  # drop the data, keep the tombstone
            s.chain, s.frozen = [], []


def canonical_assistant(msg: dict[str, Any]) -> dict[str, Any]:
    """What must be equal for a client's assistant message to count as the one we answered. Reasoning is
    left out: most clients do not send it back."""
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls") or []]
    return {"content": (msg.get("content") or "").strip(), "tool_calls": calls}


def parsed_to_message(parsed: ParsedOutput) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": parsed.text}
    if parsed.tool_calls:
        msg["tool_calls"] = [
            {"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in parsed.tool_calls
        ]
    return msg


class PromptBuilder:
    """Renders template messages to prompt ids against a session chain (pure apart from the tokenizer)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        self.eos_text = tokenizer.eos_token
        self.eos_id = tokenizer.eos_token_id

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], gen: bool) -> str:
        return self.tok.apply_chat_template(messages, tools=tools or None, tokenize=False, add_generation_prompt=gen)

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def plan(
        self, session: Session, messages: list[dict[str, Any]], tools: list[dict[str, Any]]
    ) -> tuple[str, list[int], list[str], str, str]:
        """Returns (action, prompt_ids, hashes, tools_hash, prompt_text); a wipe freezes the chain."""
        hashes = [message_hash(m) for m in messages]
        th = tools_hash(tools)
        full = self.render(messages, tools, gen=True)
        if session.chain:
            last = session.chain[-1]
            k = len(last.hashes)
            if th == last.tools_hash and len(hashes) > k and hashes[:k] == last.hashes:
                ids = self._reuse_tokens(last, messages, tools, full, k)
                if ids is not None:
                    return "append", ids, hashes, th, full
                if full.startswith(last.prompt_text):
                    ids = last.record.prompt_ids + self.encode(full[len(last.prompt_text) :])
                    return "append_rerendered", ids, hashes, th, full
            session.freeze_chain("wipe")
            return "wipe", self.encode(full), hashes, th, full
        return "new", self.encode(full), hashes, th, full

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
