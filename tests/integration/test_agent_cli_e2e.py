"""Acceptance: `slime train --debug-rollout-only --agent-harness claude-code|codex` end to end, with Ray, the
real sglang-router and a `scripted` fake engine whose rules answer with tool calls. Every sample of the rollout
dump must be COMPLETED, hold ≥ 1 tool round trip, have its task done on disk (the reward reads the workspace),
and carry at mask 1 exactly the tokens the fake generated (checked against the engine's request log).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from sim.slime_run import run_slime_train
from slime.utils.types import Sample, Status

pytestmark = [pytest.mark.cpu, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_agent_cli_harnesses import SCRIPT, check_engine_tokens, require_cli  # noqa: E402

HARNESSES = {
    "claude-code": (
        "claude",
        "TASK-CC: write the notes #{i}",
        {"expect_file": ["notes/hello.txt", "hello from write\n"]},
    ),
    "codex": (
        "codex",
        "TASK-CX: change the greeting #{i}",
        {"files": {"greet.txt": "hello\n"}, "expect_file": ["greet.txt", "hello world\n"]},
    ),
}


@pytest.mark.parametrize("harness", sorted(HARNESSES))
def test_debug_rollout_only_with_cli_harness(harness: str, tmp_path: Path) -> None:
    cli, prompt, metadata = HARNESSES[harness]
    require_cli(cli)
    from sim.tiny_checkpoint import build_tiny_checkpoint

    ckpt = build_tiny_checkpoint(tmp_path / "tiny", max_position_embeddings=65536)  # the CLIs' prompts fit
    (tmp_path / "script.json").write_text(json.dumps(SCRIPT))
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"input": prompt.format(i=i), "metadata": metadata}) + "\n" for i in range(2)))
    dump = tmp_path / "dump" / "rollout_{rollout_id}.pt"
    argv = [
        "--debug-rollout-only", "--hf-checkpoint", str(ckpt), "--prompt-data", str(data), "--input-key", "input",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--num-rollout", "1", "--global-batch-size", "4",
        "--rollout-max-response-len", "256", "--rollout-max-context-len", "32768",
        "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1",
        "--rollout-engine", "sim", "--sim-engine", "scripted", "--sim-script", str(tmp_path / "script.json"),
        "--sim-request-log-dir", str(tmp_path / "engine_logs"),
        "--custom-megatron-init-path", "sim.fake_megatron.cpu_shim.apply",
        "--agent-harness", harness, "--agent-timeout", "120",
        "--custom-rm-path", "test_agent_cli_harnesses.workspace_rm",
        "--save-debug-rollout-data", str(dump), "--metrics-dir", str(tmp_path / "metrics"),
    ]  # fmt: skip
    if harness == "codex":
        # Codex's own bubblewrap sandbox fails about one apply_patch in 15 with four episodes at once in these
        # containers ("Failed to write file", measured; docs/agent.md): this test is about the gateway and the
        # trajectory, not Codex's sandbox, which the single-episode harness test exercises.
        argv += ["--agent-codex-sandbox", "bypass"]
    (tmp_path / "engine_logs").mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(Path(__file__).resolve().parent)])}
    log = tmp_path / "slime.log"
    rc = run_slime_train(argv, log, 540, env)
    assert rc == 0, log.read_text()[-6000:]

    payload = torch.load(str(dump).format(rollout_id=0), weights_only=False)
    samples = [Sample.from_dict(d) for d in payload["samples"]]
    assert len(samples) >= 4
    calls = [
        json.loads(line)
        for p in sorted((tmp_path / "engine_logs").glob("*.jsonl"))
        for line in p.read_text().splitlines()
    ]
    calls = [c for c in calls if c["endpoint"] == "/generate"]
    by_session: dict[str, list[Sample]] = {}
    for s in samples:
        assert s.status == Status.COMPLETED, s.metadata
        assert s.metadata["num_tool_calls"] >= 1 and s.reward == 1.0, s.metadata
        by_session.setdefault(s.metadata["agent_session_id"], []).append(s)
    assert len(by_session) == 4 and len({s.group_id for s in samples}) == 4
    for sid, group in by_session.items():
        mine = [c for c in calls if str(c["body"]["rid"]).startswith(sid + "-")]
        assert len(mine) >= 2  # a tool call, then the answer to its result
        check_engine_tokens(group, mine)
