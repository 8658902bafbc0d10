"""PPO through the real `slime train --colocate` CLI: critic and actor on one (logical) GPU, role overrides, resume.

Run A: 3 rollouts, `--num-critic-only-steps 2`, a `--megatron-config` giving actor and critic their own learning
rates and checkpoint dirs, a checkpoint and an HF export after every rollout. Then:

- the actor's weights after rollouts 0 and 1 are bit-identical to the starting checkpoint (only the critic
  trained), and they change in rollout 2;
- the optimizers' learning rates (logged from their param groups) are the YAML's, per role; each role wrote
  its checkpoints into its own dir;
- critic metrics are logged under `critic/`, and the actor sleeps except to train and save.

Run B resumes from A's checkpoints (`load` in the same YAML) for one more rollout: the critic loads its own
checkpoint of the actor's rollout and both train on.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from examples.toy.prepare import prepare
from sim.slime_run import run_slime_train

pytestmark = [pytest.mark.cpu, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ppo")
    prepare(out, num_train=64, num_eval=4)  # in-process: ~0.02 s, not a ~6 CPU-s interpreter
    return out


def run_slime(argv: list[str], run: Path, timeout: float = 600) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run.mkdir(parents=True, exist_ok=True)
    rc = run_slime_train([*argv, "--metrics-dir", str(run / "metrics")], run / "driver.log", timeout, env)
    assert rc == 0, (run / "driver.log").read_text()[-6000:]
    return json.loads((run / "metrics" / "summary.json").read_text())


def flags(assets: Path, run: Path, roles: Path, num_rollout: int) -> list[str]:
    return [
        "--hf-checkpoint", str(assets / "model"), "--prompt-data", str(assets / "data" / "train.jsonl"),
        "--input-key", "input", "--label-key", "label", "--apply-chat-template",
        "--custom-rm-path", "examples.toy.reward.reverse_digits_rm", "--rollout-engine", "sim", "--sim-engine", "hf",
        "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--global-batch-size", "8",
        "--num-rollout", str(num_rollout), "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1", "--colocate",
        "--rollout-max-response-len", "8", "--rollout-shuffle", "--advantage-estimator", "ppo",
        "--num-critic-only-steps", "2", "--megatron-config", str(roles), "--gamma", "0.99", "--lambd", "0.95",
        "--custom-megatron-init-path", "sim.fake_megatron.cpu_shim.apply", "--save-interval", "1",
        "--save-hf", str(run / "hf" / "{rollout_id}"),
    ]  # fmt: skip


def _weights(d: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(f).items()}


def _metrics(run: Path) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {}
    for line in (run / "metrics" / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("kind") == "train":
            out.setdefault(rec["step"], {}).update(rec["metrics"])
    return out


def test_ppo_critic_only_steps_roles_and_resume(assets, tmp_path):
    ckpt = tmp_path / "ckpt"
    roles = tmp_path / "roles.yaml"
    roles.write_text(
        "megatron:\n"
        f"  - {{name: default, role: actor, overrides: {{lr: 2e-3, save: {ckpt / 'actor'}, load: {ckpt / 'actor'}}}}}\n"
        f"  - {{name: default, role: critic, overrides: {{lr: 1e-2, save: {ckpt / 'critic'}, load: {ckpt / 'critic'}}}}}\n"
    )  # fmt: skip
    a = tmp_path / "A"
    summary = run_slime(flags(assets, a, roles, 3), a)
    start = _weights(assets / "model")
    for rid in (0, 1):
        w = _weights(a / "hf" / str(rid))
        assert w.keys() == start.keys()
        changed = [k for k in w if not torch.equal(w[k], start[k])]
        assert not changed, f"rollout {rid} (critic only): the actor's weights changed in {changed[:5]}"
    w2 = _weights(a / "hf" / "2")
    assert any(not torch.equal(w2[k], start[k]) for k in w2), "rollout 2: the actor did not train"

    m = _metrics(a)
    for rid in range(3):
        assert m[rid]["critic/lr"] == 1e-2 and m[rid]["critic/value_loss"] >= 0
        assert 0 <= m[rid]["critic/value_clipfrac"] <= 1
        assert m[rid]["memory/critic_host_asleep_bytes"] > 0
    assert m[0]["train/critic_only"] == m[1]["train/critic_only"] == 1.0 and "train/lr" not in m[1]
    assert m[2]["train/lr"] == 2e-3 and "train/critic_only" not in m[2]
    assert m[2]["memory/actor_host_asleep_bytes"] > 0
    for role in ("actor", "critic"):
        assert (ckpt / role / "latest_checkpointed_iteration.txt").read_text().strip() == "2", role
        assert (ckpt / role / "iter_0000002" / "slime_checkpoint.json").is_file(), role
    assert not (ckpt / "actor" / "critic").exists()  # the YAML's dir, not the default under the actor's
    names = [n for _, n in summary["offload_events"]]  # the actor's: asleep except to train (and save)
    assert names[0] == "sleep" and names.count("wake_up") == names.count("sleep") - 1 and "update_weights" in names

    b = tmp_path / "B"
    summary = run_slime(flags(assets, b, roles, 4), b)
    assert summary["resumed_from"] == 2 and sorted(summary["hashes"]) == ["3"]
    critic_log = (b / "metrics" / "logs" / "critic_rank0.log").read_text()
    assert "resumed from" in critic_log and "iter_0000002" in critic_log
    mb = _metrics(b)
    assert mb[3]["train/lr"] == 2e-3 and mb[3]["critic/lr"] == 1e-2
    assert (ckpt / "critic" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
