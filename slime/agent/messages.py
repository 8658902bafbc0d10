"""Protocol requests (OpenAI chat / Responses, Anthropic messages) -> chat-template messages and tool schemas.

Only what the chat template renders survives the translation: ids, `cache_control` markers, metadata and
hosted tools are dropped, and Claude Code's billing line (`x-anthropic-billing-header: ...`, which changes on
every request) is removed from the system prompt, so an unchanged history hashes the same on every request
and new / append / wipe can be decided by comparing message hashes. Template messages are plain dicts:
``{"role": system|user|assistant|tool, "content": str, "tool_calls"?: [...], "reasoning_content"?: str}``.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

IMAGE_PLACEHOLDER = "[image omitted]"
_BILLING_LINE = re.compile(r"^x-anthropic-billing-header:.*$\n?", re.MULTILINE)


class BadRequest(Exception):
    """A client error: answered with HTTP `status` and a message that names the offending field."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def _expect(cond: bool, field: str, what: str) -> None:
    if not cond:
        raise BadRequest(f"{field}: {what}")


def message_hash(msg: dict[str, Any]) -> str:
    return hashlib.sha1(json.dumps(msg, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def tools_hash(tools: list[dict[str, Any]] | None) -> str:
    return hashlib.sha1(json.dumps(tools or [], sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def _args_obj(arguments: Any, field: str) -> Any:
    """Tool-call arguments as the template wants them: a dict when the client sent JSON, else the raw string."""
    if isinstance(arguments, dict):
        return arguments
    if arguments is None or arguments == "":
        return {}
    _expect(isinstance(arguments, str), field, "must be a JSON string or an object")
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


def tool_call(name: str, arguments: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def _text_of(content: Any, field: str, *, text_types: tuple[str, ...]) -> str:
    """Flatten string-or-parts content to text (images become a placeholder, unknown parts are skipped)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    _expect(isinstance(content, list), field, "must be a string or a list of content parts")
    out = []
    for i, part in enumerate(content):
        _expect(isinstance(part, dict), f"{field}[{i}]", "must be an object")
        ptype = part.get("type")
        if ptype in text_types:
            _expect(isinstance(part.get("text"), str), f"{field}[{i}].text", "must be a string")
            out.append(part["text"])
        elif ptype in ("image_url", "image", "input_image", "input_file", "file"):
            out.append(IMAGE_PLACEHOLDER)
    return "".join(out)


def _function_schema(name: Any, description: Any, parameters: Any, field: str) -> dict[str, Any]:
    _expect(isinstance(name, str) and name, f"{field}.name", "must be a non-empty string")
    _expect(parameters is None or isinstance(parameters, dict), f"{field}.parameters", "must be an object")
    fn: dict[str, Any] = {"name": name, "description": description if isinstance(description, str) else ""}
    fn["parameters"] = parameters if parameters is not None else {"type": "object", "properties": {}}
    return {"type": "function", "function": fn}


# ---- OpenAI chat completions ---------------------------------------------------------------------------


def openai_chat_tools(tools: Any) -> list[dict[str, Any]]:
    if tools is None:
        return []
    _expect(isinstance(tools, list), "tools", "must be a list")
    out = []
    for i, t in enumerate(tools):
        _expect(isinstance(t, dict), f"tools[{i}]", "must be an object")
        if t.get("type", "function") != "function":
            continue
        fn = t.get("function")
        _expect(isinstance(fn, dict), f"tools[{i}].function", "must be an object")
        out.append(
            _function_schema(fn.get("name"), fn.get("description"), fn.get("parameters"), f"tools[{i}].function")
        )
    return out


def openai_chat_messages(messages: Any) -> list[dict[str, Any]]:
    _expect(isinstance(messages, list) and messages, "messages", "must be a non-empty list")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        f = f"messages[{i}]"
        _expect(isinstance(m, dict), f, "must be an object")
        role = m.get("role")
        _expect(role in ("system", "developer", "user", "assistant", "tool"), f"{f}.role", "unknown role")
        text = _text_of(m.get("content"), f"{f}.content", text_types=("text", "input_text", "output_text"))
        if role in ("system", "developer"):
            out.append({"role": "system", "content": text})
        elif role == "user":
            out.append({"role": "user", "content": text})
        elif role == "tool":
            out.append({"role": "tool", "content": text})
        else:
            msg: dict[str, Any] = {"role": "assistant", "content": text}
            calls = m.get("tool_calls")
            if calls:
                _expect(isinstance(calls, list), f"{f}.tool_calls", "must be a list")
                msg["tool_calls"] = []
                for j, c in enumerate(calls):
                    cf = f"{f}.tool_calls[{j}]"
                    _expect(isinstance(c, dict) and isinstance(c.get("function"), dict), cf, "needs a function")
                    fn = c["function"]
                    _expect(isinstance(fn.get("name"), str), f"{cf}.function.name", "must be a string")
                    msg["tool_calls"].append(tool_call(fn["name"], _args_obj(fn.get("arguments"), f"{cf}.function")))
            reasoning = m.get("reasoning_content")
            if isinstance(reasoning, str) and reasoning:
                msg["reasoning_content"] = reasoning
            out.append(msg)
    return out


# ---- OpenAI Responses ----------------------------------------------------------------------------------


def responses_tools(tools: Any) -> tuple[list[dict[str, Any]], set[str]]:
    """Function schemas plus the names of `custom` (free-form) tools, whose calls are answered as custom calls."""
    if tools is None:
        return [], set()
    _expect(isinstance(tools, list), "tools", "must be a list")
    out, custom = [], set()

    def add(t: Any, f: str) -> None:
        _expect(isinstance(t, dict), f, "must be an object")
        kind = t.get("type")
        if kind == "function":
            out.append(_function_schema(t.get("name"), t.get("description"), t.get("parameters"), f))
        elif kind == "custom":
            params = {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}
            out.append(_function_schema(t.get("name"), t.get("description"), params, f))
            custom.add(t["name"])
        elif kind == "namespace":
            subs = t.get("tools") or []
            _expect(isinstance(subs, list), f"{f}.tools", "must be a list")
            for j, sub in enumerate(subs):
                add(sub, f"{f}.tools[{j}]")
        # hosted tools (web_search, tool_search, file_search, ...) cannot run here: dropped

    for i, t in enumerate(tools):
        add(t, f"tools[{i}]")
    return out, custom


def responses_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        _expect(isinstance(instructions, str), "instructions", "must be a string")
        out.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        return out + [{"role": "user", "content": items}]
    _expect(isinstance(items, list) and items, "input", "must be a string or a non-empty list of items")
    pending_reasoning: str | None = None

    def assistant() -> dict[str, Any]:
        # consecutive assistant items (reasoning, message, calls) form one assistant turn
        nonlocal pending_reasoning
        if out and out[-1].get("_open"):
            return out[-1]
        msg: dict[str, Any] = {"role": "assistant", "content": "", "_open": True}
        if pending_reasoning:
            msg["reasoning_content"] = pending_reasoning
        pending_reasoning = None
        out.append(msg)
        return msg

    for i, it in enumerate(items):
        f = f"input[{i}]"
        _expect(isinstance(it, dict), f, "must be an object")
        kind = it.get("type", "message")
        if kind == "message":
            role = it.get("role")
            _expect(role in ("system", "developer", "user", "assistant"), f"{f}.role", "unknown role")
            text = _text_of(it.get("content"), f"{f}.content", text_types=("input_text", "output_text", "text"))
            if role == "assistant":
                msg = assistant()
                msg["content"] += text
            else:
                out.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind in ("function_call", "custom_tool_call"):
            _expect(isinstance(it.get("name"), str), f"{f}.name", "must be a string")
            if kind == "function_call":
                args = _args_obj(it.get("arguments"), f"{f}.arguments")
            else:
                _expect(isinstance(it.get("input", ""), str), f"{f}.input", "must be a string")
                args = {"input": it.get("input", "")}
            assistant().setdefault("tool_calls", []).append(tool_call(it["name"], args))
        elif kind in ("function_call_output", "custom_tool_call_output"):
            output = it.get("output")
            text = (
                output
                if isinstance(output, str)
                else _text_of(output, f"{f}.output", text_types=("input_text", "text", "output_text"))
            )
            out.append({"role": "tool", "content": text})
        elif kind == "reasoning":
            summary = it.get("summary") or []
            texts = [s.get("text", "") for s in summary if isinstance(s, dict)] if isinstance(summary, list) else []
            pending_reasoning = "\n".join(t for t in texts if isinstance(t, str)) or None
        # other item types (web_search_call, item_reference, ...) carry nothing the template renders
    for m in out:
        m.pop("_open", None)
    return out


# ---- Anthropic messages --------------------------------------------------------------------------------


def _anthropic_system(system: Any, field: str) -> str:
    text = _text_of(system, field, text_types=("text",))
    return _BILLING_LINE.sub("", text) if isinstance(system, str) else _strip_billing_blocks(system)


def _strip_billing_blocks(blocks: list[dict[str, Any]]) -> str:
    texts = [b.get("text", "") for b in blocks if isinstance(b, dict) and b.get("type") == "text"]
    texts = [_BILLING_LINE.sub("", t) for t in texts]
    return "\n".join(t for t in texts if t)


def anthropic_tools(tools: Any) -> list[dict[str, Any]]:
    if tools is None:
        return []
    _expect(isinstance(tools, list), "tools", "must be a list")
    out = []
    for i, t in enumerate(tools):
        _expect(isinstance(t, dict), f"tools[{i}]", "must be an object")
        if "input_schema" not in t and t.get("type") not in (None, "custom"):
            continue  # server tools (bash_2025..., web_search_...) are not ours to run
        out.append(_function_schema(t.get("name"), t.get("description"), t.get("input_schema"), f"tools[{i}]"))
    return out


def anthropic_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if body.get("system") is not None:
        system = _anthropic_system(body["system"], "system")
        if system:
            out.append({"role": "system", "content": system})
    messages = body.get("messages")
    _expect(isinstance(messages, list) and messages, "messages", "must be a non-empty list")
    for i, m in enumerate(messages):
        f = f"messages[{i}]"
        _expect(isinstance(m, dict), f, "must be an object")
        role = m.get("role")
        _expect(role in ("user", "assistant", "system"), f"{f}.role", "must be user, assistant or system")
        content = m.get("content")
        if role == "system":
            out.append({"role": "system", "content": _text_of(content, f"{f}.content", text_types=("text",))})
            continue
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        _expect(isinstance(content, list), f"{f}.content", "must be a string or a list of blocks")
        if role == "assistant":
            msg: dict[str, Any] = {"role": "assistant", "content": ""}
            for j, b in enumerate(content):
                bf = f"{f}.content[{j}]"
                _expect(isinstance(b, dict), bf, "must be an object")
                if b.get("type") == "text":
                    _expect(isinstance(b.get("text"), str), f"{bf}.text", "must be a string")
                    msg["content"] += b["text"]
                elif b.get("type") == "thinking" and isinstance(b.get("thinking"), str):
                    msg["reasoning_content"] = b["thinking"]
                elif b.get("type") == "tool_use":
                    _expect(isinstance(b.get("name"), str), f"{bf}.name", "must be a string")
                    _expect(isinstance(b.get("input", {}), dict), f"{bf}.input", "must be an object")
                    msg.setdefault("tool_calls", []).append(tool_call(b["name"], b.get("input", {})))
            out.append(msg)
            continue
        texts: list[str] = []
        for j, b in enumerate(content):
            bf = f"{f}.content[{j}]"
            _expect(isinstance(b, dict), bf, "must be an object")
            if b.get("type") == "tool_result":
                text = _text_of(b.get("content"), f"{bf}.content", text_types=("text",))
                out.append({"role": "tool", "content": text})
            elif b.get("type") == "text":
                _expect(isinstance(b.get("text"), str), f"{bf}.text", "must be a string")
                texts.append(b["text"])
            elif b.get("type") in ("image", "document"):
                texts.append(IMAGE_PLACEHOLDER)
        if texts:
            out.append({"role": "user", "content": "".join(texts)})
    return out
