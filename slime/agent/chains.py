"""Which conversation of an episode a request belongs to: the main agent's, a sub-agent's, or auxiliary calls.

Claude Code runs sub-agents (its `Agent` / `Task` tool) as separate conversations in the same episode, with the
same session headers as the parent (`tests/fixtures/agent/claude_code_subagent.jsonl` is such an episode).
Training wants each conversation as its own token context, so every request is routed to a chain before its
prompt is built. Rules, in order:

1. A request carrying the tool result of one of our `Agent`/`Task` calls closes that sub-agent's chain: its
   turns freeze as a `subagent` segment (the sub-agent is done when its parent sees the result).
2. A request for a small/fast model name (`aux_models`) goes to the auxiliary chain: served, never trained.
3. A request that strictly extends a live chain's newest turn (same messages, then more) continues that chain.
4. A sub-agent's first request: its first user message equals the `prompt` of a pending `Agent`/`Task` call and
   its billing block marks a sub-agent (`cc_is_subagent=true`; a request without billing block is not Claude
   Code and may match too). It opens a chain for that call, so parallel sub-agents get one chain each. A
   sub-agent request repeating the prompt of a live sub chain (a retry, or the sub-agent's own compaction) goes
   back to that chain; a marked sub-agent request matching nothing gets a chain of its own.
5. Anything else belongs to the main chain: new, retried, or rewritten (compaction), which the prompt plan
   then turns into a `wipe` segment.

Pure: works on a `Session` and the request's `RequestHints`; no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from slime.agent.parsing import ParsedOutput
from slime.agent.session import AUX_KIND, MAIN, MAIN_KIND, SUBAGENT_KIND, Session

SUBAGENT_TOOLS = ("Agent", "Task")
AUX_CHAIN = "aux"
_BILLING = re.compile(r"x-anthropic-billing-header:[^\n]*")
_OUR_ID_PREFIXES = ("toolu_", "call_")


@dataclass(frozen=True)
class RequestHints:
    """What routing needs from a request that the chat template does not render."""

    model: str | None = None
    is_subagent: bool | None = None  # Claude Code's billing block: True/False; None when there is none
    first_user_texts: tuple[str, ...] = ()  # text parts of the first user message
    tool_result_ids: tuple[str, ...] = ()  # ids of the tool calls this request answers


def call_key(tool_id: str) -> str:
    """Our tool-call ids are `toolu_<rid>_<i>` (Anthropic) or `call_<rid>_<i>` (OpenAI): key on `<rid>_<i>`."""
    for p in _OUR_ID_PREFIXES:
        if tool_id.startswith(p):
            return tool_id[len(p) :]
    return tool_id


def _is_task_prompt(texts: tuple[str, ...], prompt: str | None) -> bool:
    p = (prompt or "").strip()
    if not p or not texts:
        return False
    return any(t.strip() == p for t in texts) or "".join(texts).strip().endswith(p)


def _extends(prefix: list[str], hashes: list[str], strict: bool) -> bool:
    k = len(prefix)
    return (len(hashes) > k if strict else len(hashes) == k) and hashes[:k] == prefix


def route(s: Session, hints: RequestHints, hashes: list[str], aux_models: Collection[str] = ()) -> str:
    """The chain id for this request (opening or closing chains on `s` as the rules above say)."""
    for tid in hints.tool_result_ids:
        key = call_key(tid)
        s.pending.pop(key, None)
        if f"sub:{key}" in s.chains:
            s.freeze(f"sub:{key}", SUBAGENT_KIND, close=True)
    if hints.model is not None and hints.model in aux_models:
        s.open_chain(AUX_CHAIN, AUX_KIND)
        return AUX_CHAIN
    best, best_len = None, -1
    for cid, ch in s.chains.items():
        last = s.last_turn(cid)
        if ch.kind != AUX_KIND and last is not None and len(last.hashes) > best_len:
            if _extends(last.hashes, hashes, strict=True):
                best, best_len = cid, len(last.hashes)
    if best is not None:
        return best
    if hints.is_subagent is not False and hints.first_user_texts:
        for key, (prompt, _parent) in list(s.pending.items()):
            if _is_task_prompt(hints.first_user_texts, prompt):
                del s.pending[key]
                s.open_chain(f"sub:{key}", SUBAGENT_KIND, prompt)
                return f"sub:{key}"
        for cid, ch in s.chains.items():
            if ch.kind == SUBAGENT_KIND and _is_task_prompt(hints.first_user_texts, ch.prompt):
                return cid
        if hints.is_subagent:
            s.seq += 1
            cid = f"sub:?{s.seq}"
            s.open_chain(cid, SUBAGENT_KIND, "\n".join(hints.first_user_texts))
            return cid
    for cid in s.chains:
        last = s.last_turn(cid)
        if cid != AUX_CHAIN and last is not None and _extends(last.hashes, hashes, strict=False):
            return cid  # the same request again: the plan wipes that chain
    s.open_chain(MAIN, MAIN_KIND)
    return MAIN


def register_subagent_calls(s: Session, chain_id: str, rid: str, parsed: ParsedOutput) -> None:
    """Remember the `Agent`/`Task` calls of a turn we answered: their sub-agents' first requests open chains."""
    for i, c in enumerate(parsed.tool_calls):
        prompt = c.arguments.get("prompt") if isinstance(c.arguments, dict) else None
        if c.name in SUBAGENT_TOOLS and isinstance(prompt, str) and prompt.strip():
            s.pending[f"{rid}_{i}"] = [prompt, chain_id]


# ---- hints from protocol bodies (bodies are already validated by `slime.agent.messages`) ----------------


def _texts(content: Any, kinds: tuple[str, ...]) -> tuple[str, ...]:
    if isinstance(content, str):
        return (content,)
    if not isinstance(content, list):
        return ()
    return tuple(p["text"] for p in content if isinstance(p, dict) and p.get("type") in kinds and "text" in p)


def anthropic_hints(body: dict[str, Any]) -> RequestHints:
    system = body.get("system")
    system_texts = _texts(system, ("text",))
    billing = [m.group(0) for t in system_texts for m in _BILLING.finditer(t)]
    is_sub = any("cc_is_subagent=true" in b for b in billing) if billing else None
    first: tuple[str, ...] = ()
    results: list[str] = []
    for m in body.get("messages") or []:
        if not isinstance(m, dict) or m.get("role") != "user":
            continue
        content = m.get("content")
        if not first:
            first = _texts(content, ("text",))
        if isinstance(content, list):
            for b in content:
                if isinstance(b, dict) and b.get("type") == "tool_result" and isinstance(b.get("tool_use_id"), str):
                    results.append(b["tool_use_id"])
    return RequestHints(_model(body), is_sub, first, tuple(results))


def chat_hints(body: dict[str, Any]) -> RequestHints:
    msgs = [m for m in body.get("messages") or [] if isinstance(m, dict)]
    first = next((_texts(m.get("content"), ("text",)) for m in msgs if m.get("role") == "user"), ())
    results = [m["tool_call_id"] for m in msgs if m.get("role") == "tool" and isinstance(m.get("tool_call_id"), str)]
    return RequestHints(_model(body), None, first, tuple(results))


def responses_hints(body: dict[str, Any]) -> RequestHints:
    items = body.get("input")
    if isinstance(items, str):
        return RequestHints(_model(body), None, (items,), ())
    items = [it for it in items or [] if isinstance(it, dict)]
    first = next(
        (
            _texts(it.get("content"), ("input_text", "text"))
            for it in items
            if it.get("type", "message") == "message" and it.get("role") == "user"
        ),
        (),
    )
    outputs = ("function_call_output", "custom_tool_call_output")
    results = [it["call_id"] for it in items if it.get("type") in outputs and isinstance(it.get("call_id"), str)]
    return RequestHints(_model(body), None, first, tuple(results))


def _model(body: dict[str, Any]) -> str | None:
    return body["model"] if isinstance(body.get("model"), str) else None
