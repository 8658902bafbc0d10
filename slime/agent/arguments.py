"""Flags of `slime/agent` (gateway, harnesses), registered into the one flat `args` namespace."""

from __future__ import annotations

import argparse
from typing import Any

from slime.utils.errors import SlimeArgError

CODEX_SANDBOXES = ("workspace-write", "read-only", "danger-full-access", "bypass")


def add_agent_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("agent")
    g.add_argument(
        "--agent-harness",
        default=None,
        help="agent harness driving each sample through the gateway: openai-sdk, claude-code or codex",
    )
    g.add_argument("--agent-max-turns", type=int, default=4, help="model calls per episode (openai-sdk harness)")
    g.add_argument("--agent-gateway-host", default="127.0.0.1", help="bind address of the in-process gateway")
    g.add_argument("--agent-gateway-port", type=int, default=0, help="port of the in-process gateway (0: any)")
    g.add_argument("--agent-model-name", default="slime-policy", help="model id the gateway reports to clients")
    g.add_argument(
        "--agent-store",
        default=None,
        help="gateway session store: memory (default) or redis://HOST:PORT/DB, shared by several gateway processes",
    )
    g.add_argument("--agent-timeout", type=float, default=600.0, help="wall-clock budget of one CLI episode, seconds")
    g.add_argument(
        "--agent-cli-concurrency", type=int, default=8, help="CLI episodes running at once per rollout process"
    )
    g.add_argument(
        "--agent-cli-prefix",
        default=None,
        help="npm prefix holding the agent CLIs (ci/agent_clis.sh; default $SLIME_AGENT_CLIS_PREFIX or .agent-clis/)",
    )
    g.add_argument(
        "--agent-cli-args", default=None, help="extra arguments for the agent CLI (one shell-quoted string)"
    )
    g.add_argument(
        "--agent-tools",
        default="Bash,Read,Edit,Write",
        help="claude-code: the agent's --tools list (add Agent to let the policy spawn sub-agents)",
    )
    g.add_argument(
        "--agent-aux-model",
        default="slime-small-fast",
        help="model name Claude Code uses for small/fast calls; the gateway serves it but never trains on it",
    )
    g.add_argument(
        "--agent-codex-sandbox",
        choices=CODEX_SANDBOXES,
        default="workspace-write",
        help="codex: sandbox mode (bypass = --dangerously-bypass-approvals-and-sandbox, where namespaces fail)",
    )
    g.add_argument(
        "--agent-sandbox",
        default="local",
        help="where repository-task episodes run (examples/coding_agent): local, container, or an import path "
        "to a remote sandbox factory (slime/agent/sandbox.py)",
    )
    g.add_argument(
        "--agent-sandbox-dir", default=None, help="local/container sandbox: parent directory (default: $TMPDIR)"
    )
    g.add_argument(
        "--agent-sandbox-memory-mb",
        type=int,
        default=8192,
        help="address-space limit of each sandboxed command, MiB (0: none)",
    )
    g.add_argument(
        "--agent-sandbox-cpu-seconds",
        type=int,
        default=0,
        help="CPU-time limit of each sandboxed command, seconds (0: the larger of --agent-timeout, --agent-eval-timeout)",
    )
    g.add_argument(
        "--agent-sandbox-image",
        default="slime-coding-agent:latest",
        help="container sandbox: the task image (examples/coding_agent/Dockerfile)",
    )
    g.add_argument(
        "--agent-sandbox-runtime",
        default=None,
        help="container sandbox: docker or podman (default: whichever is on PATH)",
    )
    g.add_argument(
        "--agent-eval-timeout", type=float, default=300.0, help="wall-clock budget of scoring one patch, seconds"
    )


def _drives_harness(path: str) -> bool:
    from slime.utils.misc import load_function

    return bool(getattr(load_function(path), "drives_agent_harness", False))


def resolve_agent_args(args: Any) -> None:
    """Derive `--custom-generate-function-path` from `--agent-harness` (called by argument validation).

    An explicit `--custom-generate-function-path` is an error next to a harness (which one runs would be a
    guess), unless that function declares `drives_agent_harness`: it runs the harness's CLI itself.
    """
    from slime.agent.harness import HARNESSES

    sandbox = args.agent_sandbox
    if sandbox not in ("local", "container") and "." not in str(sandbox):
        raise SlimeArgError(f"--agent-sandbox {sandbox!r}: use local, container or an import path pkg.module.factory")
    if args.agent_eval_timeout <= 0:
        raise SlimeArgError("--agent-eval-timeout must be > 0")
    store = args.agent_store
    if store and store != "memory" and not str(store).startswith(("redis://", "rediss://", "unix://")):
        raise SlimeArgError("--agent-store: use memory or a redis:// URL")
    name = args.agent_harness
    if name is None:
        return
    if name not in HARNESSES:
        raise SlimeArgError(f"--agent-harness {name!r}: known harnesses are {', '.join(sorted(HARNESSES))}")
    current = args.custom_generate_function_path
    # a generate function may run the harness's CLI itself (slime/agent/harness/repo_task.py): then it stays
    if current is not None and current != HARNESSES[name] and not _drives_harness(current):
        raise SlimeArgError(
            f"--agent-harness {name} sets the generate function; drop --custom-generate-function-path {current}"
        )
    args.custom_generate_function_path = current or HARNESSES[name]
    if args.agent_max_turns < 1:
        raise SlimeArgError("--agent-max-turns must be >= 1")
    if args.agent_timeout <= 0:
        raise SlimeArgError("--agent-timeout must be > 0")
    if args.agent_cli_concurrency <= 0:
        raise SlimeArgError("--agent-cli-concurrency must be > 0")
