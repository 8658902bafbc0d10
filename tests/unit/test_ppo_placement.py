"""`--advantage-estimator ppo` asks Ray for no more than `grpo`: the critic's ranks sit on the actor's bundles.

Both plans come from the functions the driver uses (`placement_group_size`, `train_gpu_requests`): the same
bundles, the same train ranks on them, and every bundle's fractional requests (actor, critic, a colocated engine)
still fit one GPU.
"""

from __future__ import annotations

import pytest

from slime.arguments import parse_args
from slime.ray.placement import placement_group_size
from slime.ray.rollout_servers import ENGINE_GPU
from slime.ray.train_group import train_gpu_requests, train_roles

pytestmark = pytest.mark.cpu


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    from sim.tiny_checkpoint import build_tiny_checkpoint

    return str(build_tiny_checkpoint(tmp_path_factory.mktemp("placement") / "model"))


@pytest.mark.parametrize(
    "layout",
    [
        ("--colocate", "--actor-num-gpus-per-node", "8"),
        (
            "--colocate",
            "--actor-num-nodes",
            "2",
            "--actor-num-gpus-per-node",
            "8",
            "--tensor-model-parallel-size",
            "2",
        ),
        ("--actor-num-gpus-per-node", "4", "--rollout-num-gpus", "4"),
        ("--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "6", "--rollout-num-gpus-per-engine", "2"),
        ("--debug-train-only", "--actor-num-gpus-per-node", "4"),
    ],
)
def test_ppo_placement_plan_is_grpo_s(hf_dir, layout):
    base = ["--hf-checkpoint", hf_dir, "--rollout-batch-size", "8", "--num-rollout", "1", *layout]
    grpo = parse_args([*base, "--advantage-estimator", "grpo"])
    ppo = parse_args([*base, "--advantage-estimator", "ppo"])
    assert train_roles(grpo) == ["actor"] and train_roles(ppo) == ["critic", "actor"]
    assert placement_group_size(ppo) == placement_group_size(grpo)
    bundles, _ = placement_group_size(ppo)
    g, p = train_gpu_requests(grpo, bundles), train_gpu_requests(ppo, bundles)
    assert p.keys() == g.keys() and max(p) < bundles  # the same bundles, rank i on bundle i
    for b, roles in p.items():
        assert roles["actor"] == g[b]["actor"]
        engine = ENGINE_GPU if ppo.colocate else 0.0  # a colocated engine's actor shares a train bundle
        assert sum(roles.values()) + engine <= 1.0
    assert ppo.offload_train  # the two models take turns on each GPU
