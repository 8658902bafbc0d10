"""OpenAI chat completions and Responses: request translation and answer shapes (JSON and SSE).

Shapes follow what the openai Python SDK 3.57, openai-agents 0.24 and Codex 0.171 parse (their stream
readers, and https://platform.openai.com/docs/api-reference/chat-streaming and
https://platform.openai.com/docs/api-reference/responses-streaming): chat chunks `chat.completion.chunk` (role delta first, tool-call deltas with index/id/name then arguments, final
chunk with finish_reason, optional usage chunk, `[DONE]`); Responses events `response.created`,
`response.output_item.added/done`, `response.content_part.added/done`, `response.output_text.delta/done`,
`response.function_call_arguments.delta/done`, `response.completed`. The SSE preamble is sent before the
engine is called, so a client that drops the stream cancels (and aborts) the generation; an error after it
is sent in-band by the gateway as an `error` event carrying the OpenAI error object.
"""

from __future__ import annotations

import json
import time
from typing import Any

from aiohttp import web

from slime.agent.api import ApiRequest, TurnResult, TurnRunner, open_sse, request_params, send
from slime.agent.chains import chat_hints, responses_hints
from slime.agent.messages import openai_chat_messages, openai_chat_tools, responses_messages, responses_tools
from slime.agent.session import Session


def _tool_args_json(args: dict[str, Any]) -> str:
    if set(args) == {"_raw_arguments"}:
        return str(args["_raw_arguments"])
    return json.dumps(args, ensure_ascii=False)


# ---- chat completions ----------------------------------------------------------------------------------


def _chat_finish(r: TurnResult) -> str:
    if r.parsed.tool_calls:
        return "tool_calls"
    return "length" if r.finish_reason == "length" else "stop"


def _usage(r: TurnResult) -> dict[str, int]:
    return {
        "prompt_tokens": r.prompt_tokens,
        "completion_tokens": r.completion_tokens,
        "total_tokens": r.prompt_tokens + r.completion_tokens,
    }


def _chat_tool_calls(r: TurnResult) -> list[dict[str, Any]]:
    return [
        {
            "id": f"call_{r.rid}_{i}",
            "type": "function",
            "function": {"name": c.name, "arguments": _tool_args_json(c.arguments)},
        }
        for i, c in enumerate(r.parsed.tool_calls)
    ]


def _model(body: dict[str, Any]) -> str | None:
    return body["model"] if isinstance(body.get("model"), str) else None


def chat_request(body: dict[str, Any]) -> ApiRequest:
    """A chat-completions body as the gateway reads it."""
    opts = body.get("stream_options")
    return ApiRequest(
        "/chat/completions",
        openai_chat_messages(body.get("messages")),
        openai_chat_tools(body.get("tools")),
        request_params(body, max_tokens="max_tokens", stop="stop"),
        chat_hints(body),
        _model(body),
        bool(body.get("stream")),
        {"include_usage": bool(opts.get("include_usage")) if isinstance(opts, dict) else False},
    )


async def chat_completions(gw: TurnRunner, request: web.Request, s: Session, req: ApiRequest) -> web.StreamResponse:
    model = req.model or gw.model_name
    created = int(time.time())
    if not req.stream:
        r = await gw.run_turn(s, req)
        msg: dict[str, Any] = {"role": "assistant", "content": r.parsed.text or None}
        if r.parsed.reasoning:
            msg["reasoning_content"] = r.parsed.reasoning
        if r.parsed.tool_calls:
            msg["tool_calls"] = _chat_tool_calls(r)
        return web.json_response(
            {
                "id": f"chatcmpl-{r.rid}",
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": [{"index": 0, "message": msg, "logprobs": None, "finish_reason": _chat_finish(r)}],
                "usage": _usage(r),
            },
            headers=r.headers(),
        )
    resp = await open_sse(request)
    rid = gw.new_rid(s)
    chunk_id = f"chatcmpl-{rid}"

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {
            "id": chunk_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        }

    await send(resp, chunk({"role": "assistant", "content": ""}))
    r = await gw.run_turn(s, req, rid)  # an error now goes in-band (the gateway's)
    if r.parsed.reasoning:
        await send(resp, chunk({"reasoning_content": r.parsed.reasoning}))
    if r.parsed.text:
        await send(resp, chunk({"content": r.parsed.text}))
    for i, call in enumerate(_chat_tool_calls(r)):
        head = {
            "index": i,
            "id": call["id"],
            "type": "function",
            "function": {"name": call["function"]["name"], "arguments": ""},
        }
        await send(resp, chunk({"tool_calls": [head]}))
        await send(
            resp, chunk({"tool_calls": [{"index": i, "function": {"arguments": call["function"]["arguments"]}}]})
        )
    await send(resp, chunk({}, _chat_finish(r)))
    if req.extra["include_usage"]:
        last = chunk({})
        last["choices"] = []
        last["usage"] = _usage(r)
        await send(resp, last)
    await send(resp, "[DONE]")
    await resp.write_eof()
    return resp


# ---- Responses -----------------------------------------------------------------------------------------


def _response_items(r: TurnResult, custom: set[str]) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    if r.parsed.reasoning:
        items.append(
            {
                "type": "reasoning",
                "id": f"rs_{r.rid}",
                "summary": [{"type": "summary_text", "text": r.parsed.reasoning}],
                # opaque state clients echo back verbatim (Codex does): names the engine call
                "encrypted_content": f"slime:{r.rid}",
            }
        )
    if r.parsed.text or not r.parsed.tool_calls:
        items.append(
            {
                "type": "message",
                "id": f"msg_{r.rid}",
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": r.parsed.text, "annotations": [], "logprobs": []}],
            }
        )
    for i, c in enumerate(r.parsed.tool_calls):
        if c.name in custom:
            items.append(
                {
                    "type": "custom_tool_call",
                    "id": f"ctc_{r.rid}_{i}",
                    "call_id": f"call_{r.rid}_{i}",
                    "name": c.name,
                    "input": str(c.arguments.get("input", _tool_args_json(c.arguments))),
                    "status": "completed",
                }
            )
        else:
            items.append(
                {
                    "type": "function_call",
                    "id": f"fc_{r.rid}_{i}",
                    "call_id": f"call_{r.rid}_{i}",
                    "name": c.name,
                    "arguments": _tool_args_json(c.arguments),
                    "status": "completed",
                }
            )
    return items


def _response_obj(rid: str, model: str, created: int, req: ApiRequest, status: str) -> dict[str, Any]:
    return {
        "id": f"resp_{rid}",
        "object": "response",
        "created_at": created,
        "status": status,
        "model": model,
        "output": [],
        "error": None,
        "incomplete_details": None,
        "instructions": req.extra["instructions"],
        "metadata": {},
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "temperature": None,
        "top_p": None,
        "usage": None,
    }


def _finish_response(obj: dict[str, Any], r: TurnResult, items: list[dict[str, Any]]) -> dict[str, Any]:
    obj["output"] = items
    obj["status"] = "incomplete" if r.finish_reason == "length" else "completed"
    if r.finish_reason == "length":
        obj["incomplete_details"] = {"reason": "max_output_tokens"}
    obj["usage"] = {
        "input_tokens": r.prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": r.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": r.prompt_tokens + r.completion_tokens,
    }
    return obj


def responses_request(body: dict[str, Any]) -> ApiRequest:
    """A Responses body as the gateway reads it."""
    tools, custom = responses_tools(body.get("tools"))
    instructions = body.get("instructions") if isinstance(body.get("instructions"), str) else None
    return ApiRequest(
        "/responses",
        responses_messages(body),
        tools,
        request_params(body, max_tokens="max_output_tokens", stop="stop"),
        responses_hints(body),
        _model(body),
        bool(body.get("stream")),
        {"custom": sorted(custom), "instructions": instructions},
    )


async def responses(gw: TurnRunner, request: web.Request, s: Session, req: ApiRequest) -> web.StreamResponse:
    custom = set(req.extra["custom"])
    model = req.model or gw.model_name
    created = int(time.time())
    if not req.stream:
        r = await gw.run_turn(s, req)
        obj = _response_obj(r.rid, model, created, req, "completed")
        return web.json_response(_finish_response(obj, r, _response_items(r, custom)), headers=r.headers())
    resp = await open_sse(request)
    seq = 0

    async def event(kind: str, **data: Any) -> None:
        nonlocal seq
        await send(resp, {"type": kind, "sequence_number": seq, **data}, event=kind)
        seq += 1

    rid = gw.new_rid(s)
    obj = _response_obj(rid, model, created, req, "in_progress")
    await event("response.created", response=obj)
    await event("response.in_progress", response=obj)
    r = await gw.run_turn(s, req, rid)  # an error now goes in-band (the gateway's)
    items = _response_items(r, custom)
    for idx, item in enumerate(items):
        shell = dict(item, status="in_progress")
        if item["type"] == "message":
            shell["content"] = []
        elif item["type"] == "function_call":
            shell["arguments"] = ""
        await event("response.output_item.added", output_index=idx, item=shell)
        if item["type"] == "message":
            text = item["content"][0]["text"]
            part0 = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            where = {"item_id": item["id"], "output_index": idx, "content_index": 0}
            await event("response.content_part.added", **where, part=part0)
            if text:
                await event("response.output_text.delta", **where, delta=text, logprobs=[])
            await event("response.output_text.done", **where, text=text, logprobs=[])
            await event("response.content_part.done", **where, part=item["content"][0])
        elif item["type"] == "function_call":
            where = {"item_id": item["id"], "output_index": idx}
            await event("response.function_call_arguments.delta", **where, delta=item["arguments"])
            await event("response.function_call_arguments.done", **where, arguments=item["arguments"])
        await event("response.output_item.done", output_index=idx, item=item)
    await event("response.completed", response=_finish_response(obj, r, items))
    await resp.write_eof()
    return resp
