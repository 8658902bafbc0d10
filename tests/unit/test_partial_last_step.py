"""`--allow-partial-last-step`: the leftover groups form a last step of b < B groups, loss /b, LR step +b."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from slime.algorithms.reducers import scale_for_megatron, sum_of_group_mean
from slime.scheduling import build_schedule, build_schedule_from_args, group_mask_sums
from slime.scheduling.arguments import validate_batching_args
from slime.utils.types import Sample

pytestmark = pytest.mark.cpu


class RecordingScheduler:
    """Stands in for Megatron's OptimizerParamScheduler: counts what `step(increment=...)` receives."""

    def __init__(self) -> None:
        self.increments: list[int] = []

    def step(self, increment: int) -> None:
        self.increments.append(increment)


def _train_step_loss(step, x, m, group_ids):
    """One rank's reduced loss for a step through the real scaling chain (dp = cp = 1)."""
    denoms = group_mask_sums([mm.tolist() for mm in m], group_ids)
    total = torch.zeros((), dtype=torch.float64)
    for mb in step.micro_batches[0]:
        r = sum_of_group_mean([x[i] for i in mb], [m[i] for i in mb], [denoms[i] for i in mb])
        loss, num_tokens = scale_for_megatron(
            r,
            num_microbatches=step.num_microbatches,
            global_batch_size=step.global_batch_size,
            dp_cp_size=1,
            cp_size=1,
        )
        total = total + loss / num_tokens / step.num_microbatches  # Megatron's forward_step_calc_loss
    return total


def test_partial_last_step_scales_loss_and_lr_by_b():
    # 5 groups (uneven fan-out), B = 2: steps of 2, 2 and a partial step of 1 group
    group_ids = [0, 0, 1, 2, 3, 3, 3, 4]
    x = [torch.full((3,), float(g + 1), dtype=torch.float64) for g in group_ids]
    m = [torch.ones(3, dtype=torch.float64) for _ in group_ids]
    sched = build_schedule(
        [5] * len(group_ids),
        group_ids,
        global_batch_size=2,
        dp_size=1,
        use_dynamic_batch_size=True,
        max_tokens_per_gpu=10,
        allow_partial_last_step=True,
    )
    assert [s.group_ids for s in sched.steps] == [[0, 1], [2, 3], [4]]
    assert sched.leftover_group_ids == [] and sched.global_batch_sizes == [2, 2, 1]
    last = sched.steps[-1]
    assert last.is_partial and last.global_batch_size == 1 and last.lr_increment == 1
    assert not sched.steps[0].is_partial and sched.steps[0].lr_increment == 2

    # loss of each step = (1/b) * sum of group token means; for the partial step b = 1, not B = 2
    assert _train_step_loss(sched.steps[0], x, m, group_ids).item() == pytest.approx((1 + 2) / 2, rel=1e-12)
    assert _train_step_loss(last, x, m, group_ids).item() == pytest.approx(5.0 / 1, rel=1e-12)

    lr = RecordingScheduler()
    for step in sched.steps:
        lr.step(increment=step.lr_increment)
    assert lr.increments == [2, 2, 1]  # samples-seen (= groups) semantics: total equals groups trained


def test_without_the_flag_the_groups_are_left_over():
    sched = build_schedule([5] * 5, [0, 1, 2, 3, 4], global_batch_size=2, dp_size=1)
    assert sched.global_batch_sizes == [2, 2]
    assert sched.leftover_group_ids == [4] and sched.leftover_sample_indices == [4]


def test_partial_step_smaller_than_dp_runs_empty_micro_batches():
    # one leftover group with one sample on 4 DP ranks: three ranks run an empty micro-batch, nothing is dropped
    sched = build_schedule([5] * 9, list(range(9)), global_batch_size=4, dp_size=4, allow_partial_last_step=True)
    last = sched.steps[-1]
    assert last.global_batch_size == 1 and last.num_microbatches == 1
    assert sorted(len(last.micro_batches[r][0]) for r in range(4)) == [0, 0, 0, 1]


def test_from_args_reads_the_flags(make_args: Callable[..., Any]):
    samples = [Sample(index=i, tokens=[0] * 4) for i in range(3)]
    args = make_args(
        num_steps_per_rollout=2, rollout_batch_size=2, n_samples_per_prompt=2, allow_partial_last_step=True
    )
    validate_batching_args(args)  # derives --global-batch-size from --num-steps-per-rollout
    assert args.global_batch_size == 2  # B = 2*2 // 2
    sched = build_schedule_from_args(args, samples, {"dp_size": 1, "cp_size": 1})
    assert sched.global_batch_sizes == [2, 1]
    assert sched.steps[-1].lr_increment == 1
