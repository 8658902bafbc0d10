"""Over a sequence of rollouts with uneven fan-out, every generated sample is trained exactly once.

Drives the RolloutManager's use of the carry buffer and the schedule (merge -> build_schedule -> defer):
groups that do not fill a step wait in the buffer with their rollout-time values and train later.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slime.arguments import default_args
from slime.scheduling import CarryBuffer, build_schedule_from_args
from slime.utils.types import Sample
from tests.hypothesis_budget import examples

pytestmark = pytest.mark.cpu


@st.composite
def rollout_sequence(draw):
    n_rollouts = draw(st.integers(1, 6))
    # groups per rollout vary (dynamic filtering, aborted groups); fan-out per group is uneven
    rollouts = [[draw(st.integers(1, 4)) for _ in range(draw(st.integers(0, 12)))] for _ in range(n_rollouts)]
    dp = draw(st.integers(1, 3))
    args = default_args(
        global_batch_size=draw(st.integers(1, 6)),
        use_dynamic_batch_size=True,
        max_tokens_per_gpu=draw(st.integers(8, 64)),
        balance_data=draw(st.booleans()),
        allow_partial_last_step=draw(st.booleans()),
    )
    lengths_seed = draw(st.integers(0, 2**16))
    return rollouts, dp, args, lengths_seed


@settings(max_examples=examples(250), deadline=None)
@given(rollout_sequence())
def test_every_generated_sample_trains_exactly_once(case):
    rollouts, dp, args, seed = case
    carry = CarryBuffer()
    uid = 0
    next_gid = 0
    generated: dict[int, float] = {}  # uid -> reward value frozen at its own rollout
    trained: list[int] = []
    carried_metric_total = 0.0
    late_groups: set[int] = set()  # groups trained in a later rollout than the one that generated them
    for rollout_id, fan_outs in enumerate(rollouts):
        samples, rewards = [], []
        for k in fan_outs:
            gid, next_gid = next_gid, next_gid + 1
            for _ in range(k):
                length = 2 + (seed * 7919 + uid * 104729) % 40
                samples.append(Sample(index=gid, group_id=gid, tokens=[0] * length, metadata={"uid": uid}))
                # a value that depends on the rollout it was computed in: a carried sample must keep it
                generated[uid] = rewards_value = float(rollout_id * 1000 + uid)
                rewards.append(rewards_value)
                uid += 1
        buffered_before = set(carry.group_ids)
        batch = carry.merge(rollout_id, samples, {"rewards": rewards})
        sched = build_schedule_from_args(args, batch.samples, {"dp_size": dp, "cp_size": 1})
        metrics = carry.defer(batch, sched.leftover_sample_indices)

        for r in range(dp):
            for i in sched.partitions[r]:
                s = batch.samples[i]
                trained.append(s.metadata["uid"])
                if batch.origin_rollout_ids[i] != rollout_id:
                    late_groups.add(s.group_id)
                assert batch.values["rewards"][i] == generated[s.metadata["uid"]]
        trained_carried = buffered_before - set(sched.leftover_group_ids)
        assert metrics["train/carried_groups"] == len(trained_carried)
        assert metrics["train/deferred_groups"] == len(sched.leftover_group_ids) == len(carry)
        carried_metric_total += metrics["train/carried_groups"]
        if args.allow_partial_last_step:
            assert len(carry) == 0

    left = [s.metadata["uid"] for g in carry._groups for s in g.samples]
    assert len(trained) == len(set(trained))  # never twice
    assert sorted(trained + left) == sorted(generated)  # never lost
    assert len(carry) < args.global_batch_size
    # the metric counted every late-trained group exactly once
    assert carried_metric_total == len(late_groups)
