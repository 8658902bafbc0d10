"""`--agent-harness` resolution and the harness's tools."""

from __future__ import annotations

import types

import pytest

from slime.agent.arguments import resolve_agent_args
from slime.agent.harness.openai_sdk import calculate, run_tool
from slime.utils.errors import SlimeArgError

pytestmark = pytest.mark.cpu


def test_harness_sets_generate_function() -> None:
    a = types.SimpleNamespace(agent_harness="openai-sdk", custom_generate_function_path=None, agent_max_turns=4)
    resolve_agent_args(a)
    assert a.custom_generate_function_path == "slime.agent.harness.openai_sdk.generate"
    none = types.SimpleNamespace(agent_harness=None, custom_generate_function_path="x.y")
    resolve_agent_args(none)
    assert none.custom_generate_function_path == "x.y"


@pytest.mark.parametrize(
    "kw",
    [
        {"agent_harness": "nope", "custom_generate_function_path": None, "agent_max_turns": 4},
        {"agent_harness": "openai-sdk", "custom_generate_function_path": "my.gen", "agent_max_turns": 4},
        {"agent_harness": "openai-sdk", "custom_generate_function_path": None, "agent_max_turns": 0},
    ],
)
def test_harness_errors(kw: dict) -> None:
    with pytest.raises(SlimeArgError):
        resolve_agent_args(types.SimpleNamespace(**kw))


def test_tools_are_safe_and_total() -> None:
    assert calculate("2+3*4") == "14" and calculate("7/2") == "3.5"
    assert calculate("__import__('os')").startswith("error") and calculate("2**999").startswith("error")
    assert calculate("1/0").startswith("error")
    meta = {"kv": {"capital": "Paris"}}
    assert run_tool("lookup", '{"key": "capital"}', meta) == '"Paris"'
    assert run_tool("lookup", '{"key": "x"}', meta).startswith("error")
    assert run_tool("calculator", "not json", meta).startswith("error") and run_tool("rm", "{}", meta).startswith(
        "error"
    )
