"""`slime train` on checkpoints with scaled RoPE: a Llama-3.1-style `llama3` and a Qwen2.5-style `yarn` config each
train 2 rollouts of the toy task on CPU (Ray, the real sglang-router, a fake `hf` engine running transformers),
with the original context set to 16 tokens so every chat-templated prompt runs past it.

The engine's log-probs (HF's scaled RoPE) and the trainer's recompute (megatron with slime's scaled RoPE) agree
on every token, before and after the weight sync; the negative control is the unit proof's (an unscaled RoPE
differs by 0.1–1.2 in the logits: tests/unit/test_rope_scaling.py).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from examples.toy.prepare import prepare
from sim.slime_run import slime_train

pytestmark = [pytest.mark.cpu, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
ROPES = {
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
}  # fmt: skip


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("toy_rope")
    prepare(out, num_train=16, num_eval=4)
    return out


@pytest.mark.parametrize("rope", list(ROPES))
def test_scaled_rope_checkpoint_trains_two_rollouts(assets, tmp_path, rope):
    model = tmp_path / "model"
    shutil.copytree(assets / "model", model)
    cfg = json.loads((model / "config.json").read_text())
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0))
    cfg["rope_parameters"] = {"rope_theta": theta, **ROPES[rope]}
    cfg.pop("rope_scaling", None)
    (model / "config.json").write_text(json.dumps(cfg))
    metrics = tmp_path / "run"
    argv = [
        "--hf-checkpoint", str(model), "--prompt-data", str(assets / "data" / "train.jsonl"),
        "--input-key", "input", "--label-key", "label", "--apply-chat-template",
        "--custom-rm-path", "examples.toy.reward.reverse_digits_rm",
        "--rollout-num-gpus", "1", "--rollout-engine", "sim", "--sim-engine", "hf",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--num-rollout", "2",
        "--global-batch-size", "8", "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1",
        "--rollout-max-response-len", "10", "--custom-megatron-init-path", "sim.fake_megatron.cpu_shim.apply",
        "--lr", "1e-4", "--metrics-dir", str(metrics),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with slime_train(argv, tmp_path / "run.log", env) as proc:
        rc = proc.wait(timeout=600)
    assert rc == 0, (tmp_path / "run.log").read_text()[-6000:]
    rows = [json.loads(x) for x in (metrics / "metrics.jsonl").read_text().splitlines() if x.strip()]
    train = [r["metrics"] for r in rows if r["kind"] == "train"]
    assert len(train) == 2
    assert all(m["train/update_successful"] == 1.0 for m in train)
    # engine (HF) and trainer (megatron) apply the same scaled RoPE, past the 16-token original context
    assert all(m["train/train_rollout_logprob_abs_diff_max"] < 1e-3 for m in train), train
