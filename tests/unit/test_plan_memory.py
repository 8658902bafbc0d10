"""`slime plan`'s memory section: the per-phase table with both offload policies, the peaks per rank, `--json`,
and the exit code of a configuration that cannot fit (before anything launches)."""

from __future__ import annotations

import json

import pytest

from slime.plan_cli import main as plan_main

pytestmark = pytest.mark.cpu

QWEN_1_5B = {
    "model_type": "qwen2", "hidden_size": 1536, "num_hidden_layers": 28, "num_attention_heads": 12,
    "num_key_value_heads": 2, "intermediate_size": 8960, "vocab_size": 151936, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0, "tie_word_embeddings": True, "max_position_embeddings": 32768, "hidden_act": "silu",
}  # fmt: skip
FLAGS = ["--colocate", "--actor-num-gpus-per-node", "8", "--advantage-estimator", "ppo", "--bf16",
         "--use-dynamic-batch-size", "--max-tokens-per-gpu", "8192", "--sglang-mem-fraction-static", "0.5"]  # fmt: skip


@pytest.fixture
def ckpt(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN_1_5B))
    return str(tmp_path)


def test_json_has_both_policies_and_the_6_byte_saving(ckpt, capsys):
    assert plan_main(["--json", "--hf-checkpoint", ckpt, *FLAGS]) == 0
    out = json.loads(capsys.readouterr().out)
    mem = out["memory"]
    assert mem["selected"] == "v0.3.0" and set(mem["policies"]) == {"v0.3.0", "legacy"}
    new, old = (mem["policies"][p]["stages"][0] for p in ("v0.3.0", "legacy"))
    assert new["params"] == {"critic": 1_543_714_304 + 1537, "actor": 1_543_714_304}  # + the value head
    rollout = {p: next(x for x in s["phases"] if x["phase"] == "rollout") for p, s in (("new", new), ("old", old))}
    assert rollout["old"]["host_total"] - rollout["new"]["host_total"] == 6 * sum(new["params"].values())
    assert [x["phase"] for x in new["phases"]] == [
        "rollout", "critic_values", "critic_train", "actor_log_probs", "actor_train", "weight_sync",
    ]  # fmt: skip
    assert new["peak_gpu_phase"] == "actor_train" and mem["policies"]["v0.3.0"]["feasible"]


def test_table_and_refusal_of_what_cannot_fit(ckpt, capsys):
    assert plan_main(["--hf-checkpoint", ckpt, *FLAGS, "--legacy-offload"]) == 0
    out = capsys.readouterr().out
    assert "host GiB, legacy (selected)" in out and "host GiB, v0.3.0" in out and "peaks per rank" in out
    assert plan_main(["--hf-checkpoint", ckpt, *FLAGS, "--gpu-memory-gib", "24"]) == 1
    out = capsys.readouterr().out
    assert "DOES NOT FIT (v0.3.0): stage 0: actor_train needs" in out
    assert plan_main(["--hf-checkpoint", ckpt, *FLAGS, "--host-memory-gib", "32"]) == 1
    assert "host: 8 ranks per node need" in capsys.readouterr().out


def test_without_a_config_json_only_the_deployment_plan(capsys):
    assert plan_main(["--hf-checkpoint", "/nowhere", "--rollout-num-gpus", "2"]) == 0
    assert "memory plan: needs the model's shape" in capsys.readouterr().out


def test_train_ranks_follow_megatron_order(ckpt, capsys):
    """8 GPUs on 2 nodes as tp 2 x cp 2 x pp 2: TP neighbours adjacent, CP next, stages farthest apart; one weight
    sender per stage. The same layout sim/fake_megatron simulates (tests/property check it against megatron)."""
    flags = ["--json", "--hf-checkpoint", ckpt, "--actor-num-nodes", "2", "--actor-num-gpus-per-node", "4",
             "--rollout-num-gpus", "2", "--tensor-model-parallel-size", "2", "--context-parallel-size", "2",
             "--pipeline-model-parallel-size", "2"]  # fmt: skip
    assert plan_main(flags) == 0
    ranks = json.loads(capsys.readouterr().out)["train_ranks"]
    assert [(r["tp"], r["cp"], r["dp"], r["pp"]) for r in ranks] == [
        (0, 0, 0, 0), (1, 0, 0, 0), (0, 1, 0, 0), (1, 1, 0, 0), (0, 0, 0, 1), (1, 0, 0, 1), (0, 1, 0, 1), (1, 1, 0, 1),
    ]  # fmt: skip
    assert [(r["node"], r["gpu"]) for r in ranks][3:5] == [(0, 3), (1, 0)]
    assert [r["rank"] for r in ranks if r["sender"]] == [0, 4]
    assert plan_main(flags[1:]) == 0
    assert "train ranks (megatron order tp-cp-ep-dp-pp)" in capsys.readouterr().out
