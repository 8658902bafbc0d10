"""The CLI harnesses' pure parts: argument resolution, CLI discovery, workspaces, Claude Code's environment
and stream-json reading, Codex's config / catalog entry and event reading, and the process-group kill."""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from slime.agent.arguments import resolve_agent_args
from slime.agent.harness import claude_code, codex
from slime.agent.harness.cli import EPISODE_MARKER, Episode, Workspace, base_env, find_cli, run_cli, task_prompt
from slime.utils.async_utils import run
from slime.utils.errors import SlimeArgError
from slime.utils.types import Sample

pytestmark = pytest.mark.cpu


@pytest.mark.parametrize("name", ["claude-code", "codex"])
def test_cli_harnesses_resolve(name: str, make_args: Callable[..., Any]) -> None:
    a = make_args(agent_harness=name)
    resolve_agent_args(a)
    assert a.custom_generate_function_path == f"slime.agent.harness.{name.replace('-', '_')}.generate"


@pytest.mark.parametrize(
    "kw",
    [
        {"agent_store": "postgres://x"},
        {"agent_timeout": 0},
        {"agent_cli_concurrency": -1},
    ],
)
def test_agent_flag_errors(kw: dict, make_args: Callable[..., Any]) -> None:
    a = make_args(agent_harness="codex", **kw)
    with pytest.raises(SlimeArgError):
        resolve_agent_args(a)


def test_find_cli_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rel = "node_modules/@anthropic-ai/claude-code-linux-x64/claude"
    (tmp_path / rel).parent.mkdir(parents=True)
    (tmp_path / rel).write_text("")
    monkeypatch.delenv("SLIME_CLAUDE_BIN", raising=False)
    assert find_cli("claude", str(tmp_path)) == str(tmp_path / rel)
    monkeypatch.setenv("SLIME_CLAUDE_BIN", "/opt/claude")
    assert find_cli("claude", str(tmp_path)) == "/opt/claude"
    monkeypatch.delenv("SLIME_CODEX_BIN", raising=False)
    monkeypatch.setenv("SLIME_AGENT_CLIS_PREFIX", str(tmp_path / "none"))
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr("slime.agent.harness.cli.DEFAULT_PREFIX", tmp_path / "none")
    with pytest.raises(FileNotFoundError, match="ci/agent_clis.sh"):
        find_cli("codex")


def test_workspace_seeds_files_and_refuses_escapes(monkeypatch: pytest.MonkeyPatch) -> None:
    ws = Workspace.create(Sample(index=0, prompt="p", metadata={"files": {"a/b.txt": "x"}}))
    try:
        assert (ws.workdir / "a" / "b.txt").read_text() == "x" and ws.home.is_dir()
        env = base_env(ws)
        assert env["HOME"] == str(ws.home) and env[EPISODE_MARKER] == ws.root.name
        assert "OPENAI_API_KEY" not in env and "ANTHROPIC_API_KEY" not in env
    finally:
        ws.remove()
    assert not ws.root.exists()
    made: list[str] = []
    real_mkdtemp = tempfile.mkdtemp

    def mkdtemp(**kw: str) -> str:
        made.append(real_mkdtemp(**kw))
        return made[-1]

    monkeypatch.setattr("slime.agent.harness.cli.tempfile.mkdtemp", mkdtemp)
    with pytest.raises(ValueError, match="leaves the working directory"):
        Workspace.create(Sample(index=0, prompt="p", metadata={"files": {"../evil": "x"}}))
    assert made and not Path(made[0]).exists()  # nothing left behind
    assert task_prompt(Sample(prompt=[{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])) == "u"


def test_claude_code_env_and_command(make_args: Callable[..., Any]) -> None:
    ws = Workspace.create(Sample(index=0, prompt="p"))
    try:
        args = make_args(agent_aux_model="aux", agent_cli_args="--max-turns 5")
        env = claude_code.claude_env(args, {"base_url": "http://gw/s/k", "api_key": "k"}, ws, 60)
        assert env["ANTHROPIC_BASE_URL"] == "http://gw/s/k" and env["ANTHROPIC_AUTH_TOKEN"] == "k"
        assert env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1" and env["ANTHROPIC_SMALL_FAST_MODEL"] == "aux"
        assert ("IS_SANDBOX" in env) == (os.geteuid() == 0)
        cmd = claude_code.claude_command(args, "claude", "policy", "do it", cont=True)
        assert cmd[:3] == ["claude", "-p", "do it"] and "--continue" in cmd and cmd[-2:] == ["--max-turns", "5"]
        assert cmd[cmd.index("--tools") + 1] == "Bash,Read,Edit,Write" and "stream-json" in cmd
    finally:
        ws.remove()


def test_claude_code_stream_reading() -> None:
    lines = [
        {"type": "system", "subtype": "init"},
        {"type": "assistant", "message": {"content": [{"type": "tool_use", "name": "Bash"}]}},
        {"type": "user", "message": {"content": [{"type": "tool_result"}]}},
        {"type": "assistant", "message": {"content": [{"type": "text", "text": "ok"}]}},
        {"type": "result", "subtype": "success", "is_error": False, "num_turns": 2, "result": "ok"},
    ]
    ep = Episode()
    claude_code.read_stream("\n".join(json.dumps(x) for x in lines) + "\nnot json\n", ep)
    assert (ep.num_tool_calls, ep.final_text, ep.error, ep.extra["agent_num_turns"]) == (1, "ok", None, 2)
    compact = {"type": "result", "subtype": "success", "is_error": False, "num_turns": 0, "result": ""}
    claude_code.read_stream(json.dumps(compact), ep)
    assert ep.final_text == "ok"  # a /compact run has no answer of its own
    bad = Episode()
    claude_code.read_stream(json.dumps({"type": "result", "is_error": True, "result": "API Error: 500"}), bad)
    assert bad.error == "API Error: 500"
    none = Episode()
    claude_code.read_stream("", none)
    assert none.error


def test_codex_config_and_catalog_entry() -> None:
    conf = tomllib.loads(codex.codex_config('pol"icy', "http://gw/s/k/v1", Path("/c/catalog.json"), 30))
    assert conf["model"] == 'pol"icy' and conf["model_provider"] == "slime"
    prov = conf["model_providers"]["slime"]
    assert prov["wire_api"] == "responses" and prov["base_url"] == "http://gw/s/k/v1"
    assert prov["env_key"] == "SLIME_GATEWAY_API_KEY" and prov["stream_max_retries"] == 2
    assert conf["analytics"]["enabled"] is False and conf["features"]["plugins"] is False
    assert conf["agents"]["enabled"] is False and conf["web_search"] == "disabled"
    tmpl = {"slug": "gpt-5.5", "apply_patch_tool_type": "freeform", "context_window": 272000, "upgrade": {"x": 1}}
    entry = codex.catalog_entry(tmpl, "policy", 4096)
    assert entry["slug"] == "policy" and entry["apply_patch_tool_type"] == "freeform"
    assert entry["context_window"] == entry["max_context_window"] == 4096 and entry["upgrade"] is None
    assert tmpl["slug"] == "gpt-5.5"  # the cached template is not modified


def test_codex_event_reading() -> None:
    events = [
        {"type": "thread.started"},
        {"type": "item.completed", "item": {"type": "reasoning", "text": "r"}},
        {"type": "item.completed", "item": {"type": "file_change", "changes": []}},
        {"type": "item.completed", "item": {"type": "command_execution", "exit_code": 0}},
        {"type": "item.completed", "item": {"type": "agent_message", "text": "done"}},
        {"type": "turn.completed", "usage": {}},
    ]
    ep = Episode()
    codex.read_events("\n".join(json.dumps(e) for e in events), ep)
    assert (ep.num_tool_calls, ep.final_text, ep.error) == (2, "done", None)
    failed = Episode()
    codex.read_events(json.dumps({"type": "turn.failed", "error": {"message": "stream closed"}}), failed)
    assert failed.error == "stream closed"


def test_run_cli_kills_the_group_on_timeout_and_cancel(tmp_path: Path) -> None:
    import psutil

    env = {"PATH": os.environ["PATH"], EPISODE_MARKER: "unit-marker"}
    script = "sleep 29.111 & (setsid sleep 29.222 &) ; echo started; sleep 29.333"
    res = run(run_cli(["bash", "-c", script], cwd=str(tmp_path), env=env, timeout_s=1.0))
    assert res.timed_out and "started" in res.stdout

    async def cancelled() -> None:
        task = asyncio.create_task(run_cli(["bash", "-c", script], cwd=str(tmp_path), env=env, timeout_s=60))
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(cancelled())
    left = [p for p in psutil.process_iter(["cmdline"]) if "29.111" in " ".join(p.info["cmdline"] or [])]
    left += [p for p in psutil.process_iter(["cmdline"]) if "29.222" in " ".join(p.info["cmdline"] or [])]
    assert not left, [p.info["cmdline"] for p in left]
    ok = run(run_cli(["bash", "-c", "echo hi; exit 3"], cwd=str(tmp_path), env=env, timeout_s=10))
    assert (ok.returncode, ok.stdout, ok.timed_out) == (3, "hi\n", False)
