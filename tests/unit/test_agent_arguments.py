"""`--agent-harness` resolution and the harness's tools."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from slime.agent.arguments import resolve_agent_args
from slime.agent.harness.openai_sdk import calculate, run_tool
from slime.utils.errors import SlimeArgError

pytestmark = pytest.mark.cpu


def test_harness_sets_generate_function(make_args: Callable[..., Any]) -> None:
    a = make_args(agent_harness="openai-sdk")
    resolve_agent_args(a)
    assert a.custom_generate_function_path == "slime.agent.harness.openai_sdk.generate"
    none = make_args(custom_generate_function_path="x.y")
    resolve_agent_args(none)
    assert none.custom_generate_function_path == "x.y"


def test_agent_flag_defaults_live_in_the_parser(make_args: Callable[..., Any]) -> None:
    a = make_args()
    assert (a.agent_max_turns, a.agent_timeout, a.agent_cli_concurrency) == (4, 600.0, 8)
    assert (a.agent_tools, a.agent_aux_model, a.agent_codex_sandbox) == (
        "Bash,Read,Edit,Write",
        "slime-small-fast",
        "workspace-write",
    )
    assert (a.agent_gateway_host, a.agent_gateway_port, a.agent_model_name) == ("127.0.0.1", 0, "slime-policy")


@pytest.mark.parametrize(
    "kw",
    [
        {"agent_harness": "nope"},
        {"agent_harness": "openai-sdk", "custom_generate_function_path": "my.gen"},
        {"agent_harness": "openai-sdk", "agent_max_turns": 0},
        {"agent_harness": "codex", "custom_generate_function_path": "slime.agent.harness.openai_sdk.generate"},
        {"agent_sandbox": "docker"},
        {"agent_eval_timeout": 0},
    ],
)
def test_harness_errors(kw: dict, make_args: Callable[..., Any]) -> None:
    with pytest.raises(SlimeArgError):
        resolve_agent_args(make_args(**kw))


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


def test_a_generate_function_that_drives_the_harness_stays(make_args: Callable[..., Any]) -> None:
    path = "slime.agent.harness.repo_task.generate"
    for harness in ("claude-code", "codex"):
        a = make_args(agent_harness=harness, custom_generate_function_path=path, agent_sandbox="my.remote.factory")
        resolve_agent_args(a)
        assert a.custom_generate_function_path == path and a.agent_harness == harness
    assert make_args().agent_sandbox == "local"
