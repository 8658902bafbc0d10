"""Agent harnesses: custom generate functions that drive one sample's episode through the gateway.

`HARNESSES` maps `--agent-harness` names to their generate function's import path: `openai-sdk` (an
in-process tool loop on the openai client), `claude-code` and `codex` (the real CLIs, see `cli.py`).
"""

HARNESSES = {
    "openai-sdk": "slime.agent.harness.openai_sdk.generate",
    "claude-code": "slime.agent.harness.claude_code.generate",
    "codex": "slime.agent.harness.codex.generate",
}
