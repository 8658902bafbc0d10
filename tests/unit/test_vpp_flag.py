"""`--num-layers-per-virtual-pipeline-stage` (Megatron-LM's spelling) sets the virtual pipeline size from the
checkpoint's layer count, or is refused with one line."""

from __future__ import annotations

import json

import pytest

from slime.arguments import parse_args
from slime.utils.errors import SlimeArgError

pytestmark = pytest.mark.cpu


@pytest.fixture
def ckpt(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "num_hidden_layers": 8}))
    return str(tmp_path)


def _args(ckpt: str, *extra: str):
    return parse_args([
        "--hf-checkpoint", ckpt, "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--num-rollout", "1",
        "--actor-num-gpus-per-node", "2", "--pipeline-model-parallel-size", "2", "--rollout-num-gpus", "1", *extra,
    ])  # fmt: skip


@pytest.mark.parametrize("per,vpp", [(1, 4), (2, 2), (4, 1)])
def test_layers_per_stage_give_the_virtual_pipeline_size(ckpt, per, vpp):
    args = _args(ckpt, "--num-layers-per-virtual-pipeline-stage", str(per))
    assert args.virtual_pipeline_model_parallel_size == vpp


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--num-layers-per-virtual-pipeline-stage", "3"], "does not divide the checkpoint's 8 layers"),
        (["--num-layers-per-virtual-pipeline-stage", "1", "--virtual-pipeline-model-parallel-size", "2"], "pass one"),
        (["--num-layers-per-virtual-pipeline-stage", "0"], "needs a value >= 1"),
    ],
)
def test_impossible_requests_are_refused(ckpt, extra, message):
    with pytest.raises(SlimeArgError, match=message):
        _args(ckpt, *extra)


def test_unreadable_checkpoint_is_refused(tmp_path):
    with pytest.raises(SlimeArgError, match="layer count"):
        _args(str(tmp_path / "missing"), "--num-layers-per-virtual-pipeline-stage", "1")
