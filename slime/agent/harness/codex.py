"""`--agent-harness codex`: each sample is one real Codex CLI (npm `@openai/codex@0.171.0`) episode,
`codex exec --json <prompt>`, against the sample's gateway session.

Configuration (what each setting is for: docs/agent.md, "Codex"), written into a fresh `CODEX_HOME` per episode: a custom model provider
whose `base_url` is the session's (`wire_api = "responses"`: Codex speaks only the Responses API, always
streaming), its key in an env var; analytics, plugins, sub-agents, apps and web search off (no outbound
lookups, a smaller prompt); bounded retries (`request_max_retries`, `stream_max_retries`, and
`--disable unbounded_connection_retries`, else Codex waits forever for a gateway that is gone). A model
catalog entry for the policy's name, copied from the CLI's own `gpt-5.5` entry (`codex debug models`),
gives it the free-form `apply_patch` custom tool and the context window of `--rollout-max-context-len`.
`--agent-codex-sandbox`: `workspace-write` (default; Codex's bundled bubblewrap, seen working as root in
these containers) or `bypass` where namespaces are not available.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from slime.agent.gateway import Gateway
from slime.agent.harness.cli import (
    Episode,
    Workspace,
    base_env,
    extra_cli_args,
    find_cli,
    parse_jsonl,
    run_cli,
    run_episode,
    task_prompt,
)
from slime.utils.types import Sample

SANDBOX_FLAGS = {
    "workspace-write": ["-s", "workspace-write"],
    "read-only": ["-s", "read-only"],
    "danger-full-access": ["-s", "danger-full-access"],
    "bypass": ["--dangerously-bypass-approvals-and-sandbox"],
}
TEMPLATE_MODEL = "gpt-5.5"
TOOL_ITEMS = ("command_execution", "file_change", "mcp_tool_call", "web_search")
_templates: dict[str, dict[str, Any]] = {}


async def catalog_template(binary: str) -> dict[str, Any]:
    """The CLI's built-in `gpt-5.5` model entry (free-form apply_patch), read once per binary (concurrent
    first episodes may each read it: harmless)."""
    if binary not in _templates:
        with tempfile.TemporaryDirectory(prefix="slime-codex-") as home:
            env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": home, "CODEX_HOME": home}
            run = await run_cli([binary, "debug", "models"], cwd=home, env=env, timeout_s=60)
        if run.returncode != 0:
            raise RuntimeError(f"`codex debug models` failed ({run.returncode}): {run.stderr[-300:]}")
        models = json.loads(run.stdout)["models"]
        pick = [m for m in models if m.get("slug") == TEMPLATE_MODEL]
        pick = pick or [m for m in models if m.get("apply_patch_tool_type") == "freeform"] or models
        _templates[binary] = pick[0]
    return dict(_templates[binary])


def catalog_entry(template: dict[str, Any], model: str, context_window: int | None) -> dict[str, Any]:
    entry = dict(template, slug=model, display_name=model, description="policy served by the slime gateway")
    entry.update(
        upgrade=None,
        supports_search_tool=False,
        include_skills_usage_instructions=False,
        include_plugin_usage_instructions=False,
        include_apps_usage_instructions=False,
        additional_speed_tiers=[],
        service_tiers=[],
    )
    if context_window:
        entry.update(context_window=context_window, max_context_window=context_window)
    return entry


def codex_config(model: str, base_url: str, catalog: Path, timeout_s: float) -> str:
    q = json.dumps  # TOML basic strings take JSON's escapes
    return f"""model = {q(model)}
model_provider = "slime"
model_catalog_json = {q(str(catalog))}
model_reasoning_summary = "none"
web_search = "disabled"

[analytics]
enabled = false

[features]
plugins = false
remote_plugin = false
apps = false

[agents]
enabled = false

[model_providers.slime]
name = "slime gateway"
base_url = {q(base_url)}
env_key = "SLIME_GATEWAY_API_KEY"
wire_api = "responses"
request_max_retries = 2
stream_max_retries = 2
stream_idle_timeout_ms = {int(timeout_s * 1000)}
"""


def read_events(stdout: str, ep: Episode) -> None:
    for ev in parse_jsonl(stdout):
        kind = ev.get("type")
        item = ev.get("item") or {}
        if kind == "item.completed" and item.get("type") in TOOL_ITEMS:
            ep.num_tool_calls += 1
        elif kind == "item.completed" and item.get("type") == "agent_message":
            ep.final_text = str(item.get("text") or "")
        elif kind == "turn.failed":
            ep.error = str((ev.get("error") or {}).get("message") or "turn failed")
        elif kind == "error" and not ep.error:
            ep.error = str(ev.get("message") or "error")


async def run_codex(
    args: Any, gw: Gateway, sess: dict[str, str], sample: Sample, ws: Workspace, timeout_s: float
) -> Episode:
    binary = find_cli("codex", args.agent_cli_prefix)
    sandbox = args.agent_codex_sandbox
    codex_home = ws.home / ".codex"
    catalog = codex_home / "catalog.json"
    ctx = args.rollout_max_context_len or None
    entry = catalog_entry(await catalog_template(binary), gw.model_name, ctx)
    await ws.write_file(catalog, json.dumps({"models": [entry]}))
    config = codex_config(gw.model_name, f"{sess['base_url']}/v1", catalog, timeout_s)
    await ws.write_file(codex_home / "config.toml", config)
    env = base_env(ws)
    env.update(CODEX_HOME=str(codex_home), SLIME_GATEWAY_API_KEY=sess["api_key"])
    cmd = [binary, "exec", "--skip-git-repo-check", "--json", "--disable", "unbounded_connection_retries"]
    cmd += SANDBOX_FLAGS[sandbox] + extra_cli_args(args) + [task_prompt(sample)]
    run = await ws.exec(cmd, env, timeout_s)
    ep = Episode(returncode=run.returncode, timed_out=run.timed_out, seconds=run.seconds)
    read_events(run.stdout, ep)
    if run.timed_out:
        ep.error = f"timed out after {timeout_s:.0f}s"
    elif run.returncode != 0:
        ep.error = ep.error or f"codex exited with {run.returncode}: {run.stderr.strip()[-300:]}"
    return ep


async def generate(
    args: Any, sample: Sample, sampling_params: dict[str, Any], evaluation: bool = False
) -> list[Sample]:
    return await run_episode(args, sample, sampling_params, run_codex)
