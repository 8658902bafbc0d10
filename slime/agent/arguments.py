"""Flags of `slime/agent` (gateway, harnesses), registered into the one flat `args` namespace."""

from __future__ import annotations

import argparse


def add_agent_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("agent")
    g.add_argument(
        "--agent-harness",
        default=None,
        help="agent harness driving each sample through the gateway (e.g. openai-sdk, claude-code, codex)",
    )
