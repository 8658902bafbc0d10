"""Splitting a model's raw output into reasoning, visible text and tool calls.

Built in: Qwen/Hermes-style `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` JSON blocks, the
Qwen3-Coder XML form `<tool_call><function=NAME><parameter=K>V</parameter></function></tool_call>`
(only for declared tools, so prose that happens to contain the markers is not turned into a call), and
`<think>...</think>` reasoning (a missing opening tag is tolerated: Qwen3 templates put it in the prompt).
The parse only shapes the protocol answer; training targets are always the engine's token ids.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

_TOOL_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
_XML_FUNC = re.compile(r"<function=([^>\s]+)>(.*?)(?:</function>|\Z)", re.DOTALL)
_XML_PARAM = re.compile(r"<parameter=([^>\s]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.DOTALL)


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]
    raw_arguments: str | None = None  # set when the model's arguments were not valid JSON


@dataclass
class ParsedOutput:
    reasoning: str | None
    text: str
    tool_calls: list[ToolCall] = field(default_factory=list)


def split_reasoning(text: str) -> tuple[str | None, str]:
    if "</think>" not in text:
        if text.lstrip().startswith("<think>"):  # never closed: all of it is reasoning (cut by length)
            return text.lstrip()[len("<think>") :].strip("\n"), ""
        return None, text
    head, _, rest = text.partition("</think>")
    head = head.split("<think>", 1)[1] if "<think>" in head else head
    return head.strip("\n"), rest.lstrip("\n")


def _json_call(body: str) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
        except json.JSONDecodeError:
            return ToolCall(obj["name"], {"_raw_arguments": args}, raw_arguments=args)
        args = parsed
    if not isinstance(args, dict):
        return ToolCall(obj["name"], {"_raw_arguments": json.dumps(args)}, raw_arguments=json.dumps(args))
    return ToolCall(obj["name"], args)


def _xml_value(v: str) -> Any:
    v = v.strip("\n")
    try:
        return json.loads(v)
    except json.JSONDecodeError:
        return v


def _xml_call(body: str, declared: set[str]) -> ToolCall | None:
    m = _XML_FUNC.search(body)
    if m is None or (declared and m.group(1) not in declared):
        return None
    params = {k: _xml_value(v) for k, v in _XML_PARAM.findall(m.group(2))}
    return ToolCall(m.group(1), params)


def parse_model_output(raw: str, tool_names: Iterable[str] = ()) -> ParsedOutput:
    """`raw` is the decoded output with special tokens kept and the end-of-turn token removed."""
    reasoning, rest = split_reasoning(raw)
    declared = set(tool_names)
    calls: list[ToolCall] = []
    text_parts: list[str] = []
    pos = 0
    if declared:
        for m in _TOOL_BLOCK.finditer(rest):
            body = m.group(1).strip()
            call = _json_call(body) or _xml_call(body, declared)
            if call is None:
                continue  # left in the visible text
            calls.append(call)
            text_parts.append(rest[pos : m.start()])
            pos = m.end()
    text_parts.append(rest[pos:])
    text = "".join(text_parts).strip() if calls else "".join(text_parts).strip("\n")
    return ParsedOutput(reasoning or None, text, calls)
