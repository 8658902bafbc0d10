"""Agent harnesses: custom generate functions that drive one sample's episode through the gateway.

`HARNESSES` maps `--agent-harness` names to their generate function's import path.
"""

HARNESSES = {"openai-sdk": "slime.agent.harness.openai_sdk.generate"}
