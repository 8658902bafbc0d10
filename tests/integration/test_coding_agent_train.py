"""Acceptance of the coding-agent example (examples/coding_agent/): `slime train` with real Claude Code in
`local` sandboxes, the scripted policy behind a `scripted` fake engine, 2 rollouts of 8 episodes, real
optimizer steps on CPU. Every episode's reward must equal the outcome its task's scripted patch is known to
have (known-good patch 1; wrong fix, edited tests, deleted tests 0), the optimizer must move (grad norm > 0),
and no process of any sandbox uid may outlive the run.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from examples.coding_agent.scripted_policy import build_script, expected_reward
from sim.process_tree import sandbox_processes
from sim.slime_run import run_slime_train
from slime.utils.types import Sample, Status

pytestmark = [pytest.mark.cpu, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
TASKS = ROOT / "examples" / "coding_agent" / "tasks.jsonl"
sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_agent_cli_harnesses import require_cli  # noqa: E402


def train(
    tmp_path: Path, harness: str, extra: list[str], num_rollout: int, batch: int, n: int, data: Path = TASKS
) -> Path:
    from sim.tiny_checkpoint import build_tiny_checkpoint

    ckpt = build_tiny_checkpoint(tmp_path / "tiny", max_position_embeddings=65536)  # the CLIs' prompts fit
    (tmp_path / "script.json").write_text(json.dumps(build_script(harness)))
    metrics = tmp_path / "run"
    argv = [
        "--hf-checkpoint", str(ckpt), "--prompt-data", str(data), "--input-key", "input",
        "--custom-generate-function-path", "slime.agent.harness.repo_task.generate", "--agent-harness", harness,
        "--agent-sandbox", "local", "--agent-sandbox-dir", str(tmp_path / "sandboxes"),
        "--agent-timeout", "120", "--agent-eval-timeout", "60",
        "--rollout-batch-size", str(batch), "--n-samples-per-prompt", str(n), "--num-rollout", str(num_rollout),
        "--global-batch-size", str(batch * n), "--rollout-max-response-len", "512",
        "--rollout-max-context-len", "32768", "--rollout-temperature", "1.0",
        "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1",
        "--rollout-engine", "sim", "--sim-engine", "scripted", "--sim-script", str(tmp_path / "script.json"),
        "--custom-megatron-init-path", "sim.fake_megatron.cpu_shim.apply", "--lr", "1e-3", "--entropy-coef", "0.01",
        "--save-debug-rollout-data", str(tmp_path / "dump" / "{rollout_id}.pt"), "--metrics-dir", str(metrics),
        *extra,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    log = tmp_path / "slime.log"
    rc = run_slime_train(argv, log, 900, env)
    assert rc == 0, log.read_text()[-6000:]
    return metrics


def check_rollouts(tmp_path: Path, num_rollout: int, episodes: int) -> list[Sample]:
    everything = []
    for rid in range(num_rollout):
        payload = torch.load(tmp_path / "dump" / f"{rid}.pt", weights_only=False)
        samples = [Sample.from_dict(d) for d in payload["samples"]]
        sessions = {s.metadata["agent_session_id"] for s in samples}
        assert len(sessions) == episodes, f"rollout {rid}: {len(sessions)} episodes"
        for s in samples:
            iid = s.metadata["instance_id"]
            assert s.status == Status.COMPLETED, s.metadata.get("abort_reason")
            assert s.metadata["num_tool_calls"] == 1 and s.metadata["apply_method"] is not None, s.metadata
            want = expected_reward(iid)
            assert s.metadata["reward"] == want, (iid, s.metadata)  # per episode; the sample's reward is /K
            assert sum(s.loss_mask) > 0
        everything += samples
    assert not list((tmp_path / "sandboxes").glob("slime-sbx-*")), "a sandbox directory outlived its episode"
    assert not sandbox_processes(tmp_path / "sandboxes")
    return everything


def test_coding_agent_trains_with_claude_code(tmp_path: Path) -> None:
    require_cli("claude")
    metrics = train(tmp_path, "claude-code", [], num_rollout=2, batch=4, n=2)
    summary = json.loads((metrics / "summary.json").read_text())
    for rid in ("0", "1"):
        m = summary["metrics"][rid]
        assert m["train/grad_norm"] > 0 and m["train/update_successful"] == 1.0
    samples = check_rollouts(tmp_path, 2, 8)
    seen = {s.metadata["instance_id"] for s in samples}
    assert {expected_reward(i) for i in seen} == {0.0, 1.0}  # both outcomes were exercised


def test_coding_agent_codex_episodes(tmp_path: Path) -> None:
    require_cli("codex")
    # Codex's own bubblewrap is flaky under concurrent writes here (docs/agent.md); the sandbox isolates it
    # one task of each scripted outcome: known-good, wrong fix, edited tests, deleted test file
    rows = [json.loads(line) for line in TASKS.read_text().splitlines()]
    pick = [
        r
        for r in rows
        if r["metadata"]["instance_id"] in ("stack-peek", "median-even", "flatten-deep", "dedupe-order")
    ]
    for r in pick:
        r["metadata"]["repo"] = str(TASKS.parent / r["metadata"]["repo"])
    data = tmp_path / "four.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in pick))
    extra = ["--agent-codex-sandbox", "bypass", "--debug-rollout-only"]
    train(tmp_path, "codex", extra, num_rollout=1, batch=4, n=1, data=data)
    samples = check_rollouts(tmp_path, 1, 4)
    assert sorted(s.metadata["reward"] for s in samples) == [0.0, 0.0, 0.0, 1.0]
