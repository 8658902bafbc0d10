"""`--sequence-parallel` on the command line: accepted where the layout tests prove it (TP > 1, with PP, MoE
EP x TP with whole experts), refused with one line before Ray starts where it is a no-op or unproven."""

from __future__ import annotations

import pytest

from slime.arguments import parse_args
from slime.utils.errors import SlimeArgError
from tests.unit.test_moe_config import _QWEN3_MOE, _argv, _model

pytestmark = [pytest.mark.cpu]

_DENSE = {"model_type": "qwen2"}


@pytest.mark.parametrize(
    "cfg,extra",
    [
        (_DENSE, ["--tensor-model-parallel-size", "2"]),
        (_DENSE, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]),
        (_QWEN3_MOE, ["--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2",
                      "--expert-tensor-parallel-size", "1"]),
    ],
)  # fmt: skip
def test_sequence_parallel_accepted(tmp_path, cfg, extra):
    assert parse_args(_argv(_model(tmp_path, cfg), "--sequence-parallel", *extra)).sequence_parallel


@pytest.mark.parametrize(
    "cfg,extra,needle",
    [
        (_DENSE, ["--sequence-parallel"], "needs --tensor-model-parallel-size > 1"),
        (_DENSE, ["--sequence-parallel", "--tensor-model-parallel-size", "2", "--context-parallel-size", "2"],
         "not proven yet"),
        (_DENSE, ["--sequence-parallel", "--tensor-model-parallel-size", "2", "--advantage-estimator", "ppo"],
         "critic's value head"),
        (_QWEN3_MOE, ["--tensor-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"],
         "add --sequence-parallel"),
        (_QWEN3_MOE, ["--tensor-model-parallel-size", "2", "--sequence-parallel"], "pass --expert-tensor-parallel"),
    ],
)  # fmt: skip
def test_sequence_parallel_refused_with_one_line(tmp_path, cfg, extra, needle):
    with pytest.raises(SlimeArgError, match=needle) as e:
        parse_args(_argv(_model(tmp_path, cfg), *extra))
    assert "\n" not in str(e.value)
