"""Anthropic messages (JSON and SSE) and count_tokens.

SSE order as Claude Code and the anthropic SDK expect (https://docs.anthropic.com/en/api/messages-streaming):
`message_start`, then per block `content_block_start` -> `content_block_delta` (`thinking_delta` +
`signature_delta`, `text_delta`, `input_json_delta`) -> `content_block_stop`, then `message_delta`
(stop_reason, usage) and `message_stop`.
A thinking block's `signature` carries the engine request id: clients send it back verbatim. An error after
the stream started is sent in-band by the gateway as an `error` event with Anthropic's error object.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from slime.agent.api import ApiRequest, TurnResult, TurnRunner, open_sse, request_params, send
from slime.agent.chains import RequestHints, anthropic_hints
from slime.agent.messages import anthropic_messages, anthropic_tools
from slime.agent.session import Session


def _stop_reason(r: TurnResult) -> str:
    if r.parsed.tool_calls:
        return "tool_use"
    return "max_tokens" if r.finish_reason == "length" else "end_turn"


def _blocks(r: TurnResult) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if r.parsed.reasoning:
        blocks.append({"type": "thinking", "thinking": r.parsed.reasoning, "signature": f"slime:{r.rid}"})
    if r.parsed.text or not r.parsed.tool_calls:
        blocks.append({"type": "text", "text": r.parsed.text})
    for i, c in enumerate(r.parsed.tool_calls):
        blocks.append({"type": "tool_use", "id": f"toolu_{r.rid}_{i}", "name": c.name, "input": c.arguments})
    return blocks


def _message(rid: str, model: str) -> dict[str, Any]:
    return {
        "id": f"msg_{rid}",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": 0, "output_tokens": 0},
    }


def messages_request(body: dict[str, Any]) -> ApiRequest:
    """A messages body as the gateway reads it."""
    return ApiRequest(
        "/messages",
        anthropic_messages(body),
        anthropic_tools(body.get("tools")),
        request_params(body, max_tokens="max_tokens", stop="stop_sequences"),
        anthropic_hints(body),
        body["model"] if isinstance(body.get("model"), str) else None,
        bool(body.get("stream")),
    )


def count_tokens_request(body: dict[str, Any]) -> ApiRequest:
    """A count_tokens body: the messages and tools only (it is never answered by the engine)."""
    msgs, tools = anthropic_messages(body), anthropic_tools(body.get("tools"))
    return ApiRequest("/messages/count_tokens", msgs, tools, {}, RequestHints(), None, False)


async def messages(gw: TurnRunner, request: web.Request, s: Session, req: ApiRequest) -> web.StreamResponse:
    model = req.model or gw.model_name
    rid = gw.new_rid(s)
    if not req.stream:
        r = await gw.run_turn(s, req, rid)
        out = _message(r.rid, model)
        out.update(content=_blocks(r), stop_reason=_stop_reason(r))
        out["usage"] = {"input_tokens": r.prompt_tokens, "output_tokens": r.completion_tokens}
        return web.json_response(out, headers=r.headers())

    resp = await open_sse(request)
    await send(resp, {"type": "message_start", "message": _message(rid, model)}, event="message_start")
    await send(resp, {"type": "ping"}, event="ping")
    r = await gw.run_turn(s, req, rid)  # an error now goes in-band (the gateway's)

    async def ev(kind: str, **data: Any) -> None:
        await send(resp, {"type": kind, **data}, event=kind)

    for i, b in enumerate(_blocks(r)):
        if b["type"] == "thinking":
            await ev(
                "content_block_start", index=i, content_block={"type": "thinking", "thinking": "", "signature": ""}
            )
            await ev("content_block_delta", index=i, delta={"type": "thinking_delta", "thinking": b["thinking"]})
            await ev("content_block_delta", index=i, delta={"type": "signature_delta", "signature": b["signature"]})
        elif b["type"] == "text":
            await ev("content_block_start", index=i, content_block={"type": "text", "text": ""})
            if b["text"]:
                await ev("content_block_delta", index=i, delta={"type": "text_delta", "text": b["text"]})
        else:
            start = {"type": "tool_use", "id": b["id"], "name": b["name"], "input": {}}
            await ev("content_block_start", index=i, content_block=start)
            partial = json.dumps(b["input"], ensure_ascii=False)
            await ev("content_block_delta", index=i, delta={"type": "input_json_delta", "partial_json": partial})
        await ev("content_block_stop", index=i)
    await ev(
        "message_delta",
        delta={"stop_reason": _stop_reason(r), "stop_sequence": None},
        usage={"input_tokens": r.prompt_tokens, "output_tokens": r.completion_tokens},
    )
    await ev("message_stop")
    await resp.write_eof()
    return resp


async def count_tokens(gw: TurnRunner, request: web.Request, s: Session, req: ApiRequest) -> web.Response:
    return web.json_response({"input_tokens": await gw.count_tokens(req)})
