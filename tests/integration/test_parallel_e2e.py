"""Context and pipeline parallelism end to end, through the `slime train` CLI, Ray, the real router and 2 `hf`
fake engines, with the engines' weight checksums compared with the trainer's after every sync:

- the toy job trains 3 rollouts with `--context-parallel-size 2`, and a CP=1 replay of the very same rollouts
  gives the same per-step losses and gradient norms (1e-5);
- the toy job trains 3 rollouts with `--pipeline-model-parallel-size 2` (each stage sends its own layers) and
  `--save-hf` writes one shard per stage that transformers loads with every weight the trainer started from.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.test_toy_e2e import NUM_ROLLOUT, assets, rollout_flags, run_slime, toy_flags  # noqa: F401

pytestmark = [pytest.mark.cpu, pytest.mark.slow]

TOL = 1e-5


def _with_gpus(flags: list[str], n: int) -> list[str]:
    out = list(flags)
    out[out.index("--actor-num-gpus-per-node") + 1] = str(n)
    return out


def test_cp2_trains_the_toy_task_and_matches_cp1_on_the_same_rollouts(assets, tmp_path):  # noqa: F811
    dump = tmp_path / "dump" / "rollout_{rollout_id}.pt"
    cp2_flags = [*_with_gpus(toy_flags(assets), 2), "--context-parallel-size", "2"]
    cp2, _ = run_slime(
        [*cp2_flags, *rollout_flags(assets), "--save-debug-rollout-data", str(dump), "--check-weight-update-equal"],
        tmp_path / "cp2",
    )
    replay = ["--load-debug-rollout-data", str(dump), "--hf-checkpoint", str(assets / "model")]
    cp1, _ = run_slime([*toy_flags(assets), *replay], tmp_path / "cp1")
    assert sorted(int(k) for k in cp2["hashes"]) == list(range(NUM_ROLLOUT))
    for rid in range(NUM_ROLLOUT):
        got, want = cp2["metrics"][str(rid)], cp1["metrics"][str(rid)]
        assert got["train/update_successful"] == 1.0 and got["weight_sync/buckets"] >= 1
        for key in ("train/loss", "train/pg_loss", "train/entropy_loss", "train/grad_norm"):
            assert abs(got[key] - want[key]) <= TOL * max(1.0, abs(want[key])), (rid, key, got[key], want[key])
    assert cp2["metrics"]["0"]["train/grad_norm"] > 0


def test_pp2_trains_the_toy_task_syncs_every_stage_and_saves_hf(assets, tmp_path):  # noqa: F811
    import json

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    flags = [*_with_gpus(toy_flags(assets), 2), "--pipeline-model-parallel-size", "2"]
    hf_out = tmp_path / "hf" / "rollout_{rollout_id}"
    pp2, _ = run_slime(
        [*flags, *rollout_flags(assets), "--check-weight-update-equal", "--save-hf", str(hf_out), "--save-interval",
         str(NUM_ROLLOUT), "--save", str(tmp_path / "ckpt")],
        tmp_path / "pp2",
    )  # fmt: skip
    assert sorted(int(k) for k in pp2["hashes"]) == list(range(NUM_ROLLOUT))
    for rid in range(NUM_ROLLOUT):
        m = pp2["metrics"][str(rid)]
        assert m["train/update_successful"] == 1.0 and m["train/grad_norm"] > 0 and m["weight_sync/buckets"] >= 1
    saved = Path(str(hf_out).format(rollout_id=NUM_ROLLOUT - 1))
    index = json.loads((saved / "model.safetensors.index.json").read_text())["weight_map"]
    assert sorted(set(index.values())) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    start = load_file(str(assets / "model" / "model.safetensors"))
    assert set(index) == set(start)  # every weight, from both stages
    model = AutoModelForCausalLM.from_pretrained(saved)
    assert sum(p.numel() for p in model.parameters()) > 0


def test_colocated_tp2_syncs_exact_weights_every_rollout(assets, tmp_path):  # noqa: F811
    """Colocated TP=2: each sync's export gathers TP shards in the packer thread while the posting thread gathers
    the two ranks' payloads to the engine's leader (weight_sync.py); the engine's checksums equal the trainer's."""
    flags = [*_with_gpus(toy_flags(assets), 2), "--tensor-model-parallel-size", "2", "--colocate"]
    rollout = rollout_flags(assets)
    rollout[rollout.index("--rollout-num-gpus") + 1] = "2"
    out, _ = run_slime(
        [*flags, *rollout, "--rollout-num-gpus-per-engine", "2", "--check-weight-update-equal"], tmp_path / "tp2"
    )
    assert sorted(int(k) for k in out["hashes"]) == list(range(NUM_ROLLOUT))
    for rid in range(NUM_ROLLOUT):
        m = out["metrics"][str(rid)]
        assert m["train/update_successful"] == 1.0 and m["weight_sync/checked_tensors"] > 0, (rid, m)
        assert m["time/actor_release_weights"] >= 0 and m["weight_sync/total_s"] > 0, (rid, m)
