"""Output parsing and protocol -> template translation (pure, no servers)."""

from __future__ import annotations

import pytest

from slime.agent.messages import (
    BadRequest,
    anthropic_messages,
    anthropic_tools,
    message_hash,
    openai_chat_messages,
    responses_messages,
    responses_tools,
)
from slime.agent.parsing import parse_model_output

pytestmark = pytest.mark.cpu


def test_parse_json_tool_call_and_reasoning() -> None:
    raw = '<think>\nplan\n</think>\n\nSure.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    p = parse_model_output(raw, ["f"])
    assert (
        p.reasoning == "plan"
        and p.text == "Sure."
        and [(c.name, c.arguments) for c in p.tool_calls] == [("f", {"x": 1})]
    )


def test_parse_xml_tool_call_only_for_declared_tools() -> None:
    raw = "<tool_call>\n<function=run>\n<parameter=cmd>\nls -l\n</parameter>\n<parameter=n>\n3\n</parameter>\n</function>\n</tool_call>"
    p = parse_model_output(raw, ["run"])
    assert p.tool_calls[0].name == "run" and p.tool_calls[0].arguments == {"cmd": "ls -l", "n": 3}
    assert parse_model_output(raw, ["other"]).tool_calls == []  # undeclared: stays text
    assert parse_model_output(raw, []).text.startswith("<tool_call>")


def test_parse_invalid_arguments_kept_raw_and_unclosed_think() -> None:
    p = parse_model_output('<tool_call>{"name": "f", "arguments": "{oops"}</tool_call>', ["f"])
    assert p.tool_calls[0].arguments == {"_raw_arguments": "{oops"}
    p = parse_model_output("<think>\nstill thinking", [])
    assert p.reasoning == "still thinking" and p.text == ""
    p = parse_model_output("reasoned</think>\n\nanswer", [])  # opening tag was in the prompt (Qwen3)
    assert p.reasoning == "reasoned" and p.text == "answer"


def test_openai_chat_translation_and_field_errors() -> None:
    msgs = openai_chat_messages(
        [
            {"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {}}]},
            {
                "role": "assistant",
                "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}],
            },
            {"role": "tool", "tool_call_id": "c", "content": "r"},
        ]
    )
    assert msgs[0] == {"role": "system", "content": "be brief"}
    assert msgs[1]["content"] == "a[image omitted]"
    assert msgs[2]["tool_calls"][0]["function"] == {"name": "f", "arguments": {"x": 1}}
    assert msgs[3] == {"role": "tool", "content": "r"}
    with pytest.raises(BadRequest, match=r"messages\[0\]\.role"):
        openai_chat_messages([{"role": "wizard", "content": "x"}])
    with pytest.raises(BadRequest, match="messages: must be a non-empty list"):
        openai_chat_messages("hi")


def test_responses_translation_custom_tools_and_hosted_tools_dropped() -> None:
    tools, custom = responses_tools(
        [
            {"type": "function", "name": "exec", "parameters": {"type": "object"}},
            {"type": "custom", "name": "apply_patch", "format": {"type": "grammar"}},
            {"type": "namespace", "name": "ns", "tools": [{"type": "function", "name": "inner"}]},
            {"type": "web_search"},
        ]
    )
    assert [t["function"]["name"] for t in tools] == ["exec", "apply_patch", "inner"] and custom == {"apply_patch"}
    msgs = responses_messages(
        {
            "instructions": "sys",
            "input": [
                {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "dev"}]},
                {"role": "user", "content": "go"},
                {
                    "type": "reasoning",
                    "summary": [{"type": "summary_text", "text": "think"}],
                    "encrypted_content": "x",
                },
                {"type": "function_call", "call_id": "c1", "name": "exec", "arguments": '{"cmd": "ls"}'},
                {"type": "custom_tool_call", "call_id": "c2", "name": "apply_patch", "input": "*** Begin"},
                {"type": "function_call_output", "call_id": "c1", "output": "ok"},
                {"type": "custom_tool_call_output", "call_id": "c2", "output": "done"},
            ],
        }
    )
    assert [m["role"] for m in msgs] == ["system", "system", "user", "assistant", "tool", "tool"]
    a = msgs[3]
    assert a["reasoning_content"] == "think" and len(a["tool_calls"]) == 2
    assert a["tool_calls"][1]["function"]["arguments"] == {"input": "*** Begin"}


def test_anthropic_translation_strips_volatile_parts() -> None:
    def body(version: str, marker_on_last: bool) -> dict:
        return {
            "system": [
                {"type": "text", "text": f"x-anthropic-billing-header: cc_version={version}; cc_entrypoint=sdk-cli;"},
                {"type": "text", "text": "You are an agent.", "cache_control": {"type": "ephemeral"}},
            ],
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "text",
                            "text": "do it",
                            **({} if marker_on_last else {"cache_control": {"type": "ephemeral"}}),
                        }
                    ],
                },
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "t", "signature": "s"},
                        {"type": "tool_use", "id": "u", "name": "Bash", "input": {"command": "ls"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "u",
                            "content": [{"type": "text", "text": "out"}],
                            **({"cache_control": {"type": "ephemeral"}} if marker_on_last else {}),
                        }
                    ],
                },
            ],
        }

    a, b = anthropic_messages(body("2.1.197.38b", False)), anthropic_messages(body("2.1.197.2bb", True))
    assert [message_hash(m) for m in a] == [message_hash(m) for m in b]  # billing line + cache_control gone
    assert a[0] == {"role": "system", "content": "You are an agent."}
    assert a[2]["reasoning_content"] == "t" and a[2]["tool_calls"][0]["function"]["arguments"] == {"command": "ls"}
    assert a[3] == {"role": "tool", "content": "out"}
    assert (
        anthropic_tools(
            [{"type": "bash_20250124", "name": "bash"}, {"name": "f", "input_schema": {"type": "object"}}]
        )[0]["function"]["name"]
        == "f"
    )
    with pytest.raises(BadRequest, match=r"messages\[0\]\.content\[0\]\.input"):
        anthropic_messages(
            {"messages": [{"role": "assistant", "content": [{"type": "tool_use", "name": "f", "input": 3}]}]}
        )
