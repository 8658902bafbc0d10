"""`slime train --agent-harness openai-sdk` on the toy model: 2 rollouts with real optimizer steps.

Every trained (mask-1) token must be one the `hf` fake engine generated, in that order (read from the fake's
request log), and the optimizer steps must move the weights (grad norm > 0).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from examples.toy.prepare import prepare

pytestmark = [pytest.mark.cpu, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def _mask_one_runs(tokens: list[int], loss_mask: list[int], response_length: int) -> list[list[int]]:
    response = tokens[len(tokens) - response_length :]
    runs, cur = [], []
    for t, m in zip(response, loss_mask, strict=True):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return runs


def test_openai_sdk_harness_trains(tmp_path):
    assets = tmp_path / "toy"
    prepare(assets, num_train=32, num_eval=4)  # in-process: ~0.02 s, not a ~6 CPU-s interpreter
    logs = tmp_path / "engine_logs"
    logs.mkdir()
    metrics = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "slime.cli", "train",
        "--hf-checkpoint", str(assets / "model"), "--prompt-data", str(assets / "data" / "train.jsonl"),
        "--input-key", "input", "--label-key", "label",
        "--agent-harness", "openai-sdk", "--agent-max-turns", "2",
        "--custom-rm-path", "examples.toy.reward.reverse_digits_rm",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--num-rollout", "2", "--global-batch-size", "4",
        "--rollout-max-response-len", "12", "--rollout-max-context-len", "2048", "--rollout-temperature", "1.0",
        "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1",
        "--rollout-engine", "sim", "--sim-engine", "hf", "--sim-request-log-dir", str(logs),
        "--custom-megatron-init-path", "sim.fake_megatron.cpu_shim.apply", "--lr", "1e-3", "--entropy-coef", "0.01",
        "--save-debug-rollout-data", str(tmp_path / "dump" / "{rollout_id}.pt"), "--metrics-dir", str(metrics),
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    summary = json.loads((metrics / "summary.json").read_text())
    for rid in ("0", "1"):
        m = summary["metrics"][rid]
        assert m["train/grad_norm"] > 0 and m["train/update_successful"] == 1.0

    generated = []
    for f in logs.iterdir():
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            if rec.get("endpoint") == "/generate":
                generated += [list(r["output_ids"]) for r in rec.get("responses", []) if r.get("output_ids")]
    assert generated, "the fake engine logged no generation"
    for rid in range(2):
        samples = torch.load(tmp_path / "dump" / f"{rid}.pt", weights_only=False)["samples"]
        assert len(samples) >= 4
        for s in samples:
            runs = _mask_one_runs(s["tokens"], s["loss_mask"], s["response_length"])
            assert runs, f"sample {s['index']} has no trained token"
            for run in runs:
                assert any(run == g[: len(run)] for g in generated), f"trained tokens {run[:8]} not an engine output"
