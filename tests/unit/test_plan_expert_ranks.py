"""`slime plan` shows where each train rank sits in megatron's expert layout for MoE checkpoints."""

from __future__ import annotations

import json

import pytest

from slime.plan_cli import main as plan_main

pytestmark = pytest.mark.cpu


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> str:
    from sim.tiny_checkpoint import build_random_moe

    out = tmp_path_factory.mktemp("moe") / "model"
    build_random_moe(out, "qwen3_moe")
    return str(out)


def test_ep_and_etp_columns_follow_the_expert_layout(moe, capsys):
    """4 GPUs as TP 2 (with SP) x EP 2, experts whole on each rank (ETP 1): EP pairs are rank neighbours, as megatron's
    expert rank generator lays them out (tests/property/test_rank_layout.py checks that generator against megatron)."""
    flags = ["--json", "--hf-checkpoint", moe, "--actor-num-gpus-per-node", "4", "--colocate",
             "--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-model-parallel-size", "2",
             "--expert-tensor-parallel-size", "1"]  # fmt: skip
    assert plan_main(flags) == 0
    ranks = json.loads(capsys.readouterr().out)["train_ranks"]
    assert [(r["tp"], r["dp"], r["ep"], r["etp"]) for r in ranks] == [
        (0, 0, 0, 0),
        (1, 0, 1, 0),
        (0, 1, 0, 0),
        (1, 1, 1, 0),
    ]
    assert plan_main(flags[1:]) == 0
    assert "│ ep │ etp │" in capsys.readouterr().out.replace("┃", "│")


def test_dense_layouts_show_no_expert_columns(moe, capsys):
    assert plan_main(["--json", "--hf-checkpoint", moe, "--actor-num-gpus-per-node", "2", "--colocate"]) == 0
    assert all("ep" not in r for r in json.loads(capsys.readouterr().out)["train_ranks"])
