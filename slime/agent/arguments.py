"""Flags of `slime/agent` (gateway, harnesses), registered into the one flat `args` namespace."""

from __future__ import annotations

import argparse
from typing import Any

from slime.utils.errors import SlimeArgError


def add_agent_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("agent")
    g.add_argument(
        "--agent-harness",
        default=None,
        help="agent harness driving each sample through the gateway (e.g. openai-sdk, claude-code, codex)",
    )
    g.add_argument("--agent-max-turns", type=int, default=4, help="model calls per episode (openai-sdk harness)")
    g.add_argument("--agent-gateway-host", default="127.0.0.1", help="bind address of the in-process gateway")
    g.add_argument("--agent-gateway-port", type=int, default=0, help="port of the in-process gateway (0: any)")
    g.add_argument("--agent-model-name", default="slime-policy", help="model id the gateway reports to clients")


def resolve_agent_args(args: Any) -> None:
    """Derive `--custom-generate-function-path` from `--agent-harness` (called by argument validation).

    An explicit `--custom-generate-function-path` is an error next to a harness: which one runs would be a guess.
    """
    from slime.agent.harness import HARNESSES

    name = getattr(args, "agent_harness", None)
    if name is None:
        return
    if name not in HARNESSES:
        raise SlimeArgError(f"--agent-harness {name!r}: known harnesses are {', '.join(sorted(HARNESSES))}")
    current = getattr(args, "custom_generate_function_path", None)
    if current is not None and current != HARNESSES[name]:
        raise SlimeArgError(
            f"--agent-harness {name} sets the generate function; drop --custom-generate-function-path {current}"
        )
    args.custom_generate_function_path = HARNESSES[name]
    if getattr(args, "agent_max_turns", 1) is not None and int(getattr(args, "agent_max_turns", 1)) < 1:
        raise SlimeArgError("--agent-max-turns must be >= 1")
