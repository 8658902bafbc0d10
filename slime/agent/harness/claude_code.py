"""`--agent-harness claude-code`: each sample is one real Claude Code (npm `@anthropic-ai/claude-code@2.1.197`)
episode, `claude -p <prompt> --output-format stream-json`, against the sample's gateway session.

Configuration (what each setting is for: docs/agent.md, "Claude Code"): `ANTHROPIC_BASE_URL` = the session's base URL (its key is the path
prefix) and `ANTHROPIC_AUTH_TOKEN` = its key; `CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1` (no title side
request, no outbound lookups); `CLAUDE_CODE_DISABLE_NONSTREAMING_FALLBACK=1` (a failed stream is never
re-generated without streaming); `--dangerously-skip-permissions` with `IS_SANDBOX=1` when running as root;
`--tools` (`--agent-tools`, default `Bash,Read,Edit,Write`: a 13 KB prompt and no sub-agents; add `Agent` to
let the policy spawn sub-agents, which the gateway records as `subagent` segments);
`ANTHROPIC_SMALL_FAST_MODEL` = `--agent-aux-model`, whose calls the gateway serves but never trains.

`metadata["agent_follow_ups"]` (a list of prompts) continues the same conversation with
`claude -p <prompt> --continue` after the first run, within the same time budget; `/compact` there compacts
the history, which the gateway records as a `wipe` segment.
"""

from __future__ import annotations

import os
from typing import Any

from slime.agent.gateway import Gateway
from slime.agent.harness.cli import (
    Episode,
    Workspace,
    base_env,
    extra_cli_args,
    find_cli,
    parse_jsonl,
    run_episode,
    task_prompt,
)
from slime.utils.types import Sample


def claude_env(args: Any, sess: dict[str, str], ws: Workspace, timeout_s: float) -> dict[str, str]:
    env = base_env(ws)
    env.update(
        ANTHROPIC_BASE_URL=sess["base_url"],
        ANTHROPIC_AUTH_TOKEN=sess["api_key"],
        ANTHROPIC_SMALL_FAST_MODEL=args.agent_aux_model,
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
        CLAUDE_CODE_DISABLE_NONSTREAMING_FALLBACK="1",
        CLAUDE_CODE_MAX_RETRIES="2",
        DISABLE_TELEMETRY="1",
        DISABLE_AUTOUPDATER="1",
        DISABLE_ERROR_REPORTING="1",
        API_TIMEOUT_MS=str(int(timeout_s * 1000)),
    )
    if os.geteuid() == 0:
        env["IS_SANDBOX"] = "1"  # --dangerously-skip-permissions refuses root otherwise
    return env


def claude_command(args: Any, binary: str, model: str, prompt: str, *, cont: bool = False) -> list[str]:
    cmd = [binary, "-p", prompt, "--output-format", "stream-json", "--verbose", "--model", model]
    cmd += ["--dangerously-skip-permissions", "--tools", args.agent_tools]
    if cont:
        cmd.append("--continue")
    return cmd + extra_cli_args(args)


def read_stream(stdout: str, ep: Episode) -> None:
    """Fold one run's stream-json events into the episode: tool calls, final result, errors."""
    result = None
    for ev in parse_jsonl(stdout):
        if ev.get("type") == "assistant":
            blocks = (ev.get("message") or {}).get("content") or []
            ep.num_tool_calls += sum(1 for b in blocks if isinstance(b, dict) and b.get("type") == "tool_use")
        elif ev.get("type") == "result":
            result = ev
    if result is None:
        ep.error = ep.error or "no result event from claude"
        return
    if isinstance(result.get("result"), str) and result.get("num_turns", 1):
        ep.final_text = result["result"]
    if result.get("is_error"):
        ep.error = str(result.get("result") or result.get("subtype") or "error")
    ep.extra["agent_num_turns"] = ep.extra.get("agent_num_turns", 0) + int(result.get("num_turns") or 0)


async def run_claude(
    args: Any, gw: Gateway, sess: dict[str, str], sample: Sample, ws: Workspace, timeout_s: float
) -> Episode:
    binary = find_cli("claude", args.agent_cli_prefix)
    env = claude_env(args, sess, ws, timeout_s)
    prompts = [task_prompt(sample)] + [str(p) for p in sample.metadata.get("agent_follow_ups") or []]
    ep = Episode()
    for i, prompt in enumerate(prompts):
        left = timeout_s - ep.seconds
        run = await ws.exec(claude_command(args, binary, gw.model_name, prompt, cont=i > 0), env, left)
        ep.seconds += run.seconds
        ep.returncode = run.returncode
        read_stream(run.stdout, ep)
        if run.timed_out:  # on SIGTERM Claude Code interrupts its tool and may start one more turn: kept
            ep.timed_out, ep.error = True, f"timed out after {timeout_s:.0f}s"
            break
        if run.returncode != 0:
            ep.error = ep.error or f"claude exited with {run.returncode}: {run.stderr.strip()[-300:]}"
            break
    return ep


async def generate(
    args: Any, sample: Sample, sampling_params: dict[str, Any], evaluation: bool = False
) -> list[Sample]:
    return await run_episode(args, sample, sampling_params, run_claude)
