"""Carry-over of groups that do not fill a step: frozen values, order, metrics, checkpointing."""

from __future__ import annotations

import pytest

from slime.scheduling import CarryBuffer, build_schedule
from slime.utils.types import Sample

pytestmark = pytest.mark.cpu


def _samples(gids):
    return [Sample(index=g, group_id=g, tokens=[1, 2, 3], metadata={"n": j}) for j, g in enumerate(gids)]


def _schedule(batch, B):
    return build_schedule(
        [len(s.tokens) for s in batch.samples], [s.group_id for s in batch.samples], global_batch_size=B, dp_size=1
    )


def test_carried_groups_train_first_with_frozen_values_and_are_counted():
    carry = CarryBuffer()
    # rollout 0: 3 groups (group 2 fans out into 2 samples), B = 2 -> group 2 is carried
    batch = carry.merge(0, _samples([0, 1, 2, 2]), {"rewards": [0.5, -0.5, 1.5, 1.5]})
    sched = _schedule(batch, 2)
    m0 = carry.defer(batch, sched.leftover_sample_indices)
    assert carry.group_ids == [2]
    assert m0 == {
        "train/carried_groups": 0.0,
        "train/carried_samples": 0.0,
        "train/deferred_groups": 1.0,
        "train/deferred_samples": 2.0,
    }

    # rollout 1: its own values would differ; the carried group keeps the rollout-0 value and trains first
    batch = carry.merge(1, _samples([3, 4, 5, 6]), {"rewards": [9.0, 9.0, 9.0, 9.0]})
    assert [s.group_id for s in batch.samples] == [2, 2, 3, 4, 5, 6]
    assert batch.values["rewards"] == [1.5, 1.5, 9.0, 9.0, 9.0, 9.0]
    assert batch.origin_rollout_ids == [0, 0, 1, 1, 1, 1]
    sched = _schedule(batch, 2)
    assert sched.steps[0].group_ids == [2, 3]
    m1 = carry.defer(batch, sched.leftover_sample_indices)
    assert m1["train/carried_groups"] == 1.0 and m1["train/carried_samples"] == 2.0
    assert m1["train/deferred_groups"] == 1.0 and carry.group_ids == [6]


def test_a_carried_group_that_is_deferred_again_is_not_counted_as_trained():
    carry = CarryBuffer()
    batch = carry.merge(0, _samples([0]), {"rewards": [1.0]})
    carry.defer(batch, _schedule(batch, 3).leftover_sample_indices)
    batch = carry.merge(1, _samples([1]), {"rewards": [2.0]})
    m = carry.defer(batch, _schedule(batch, 3).leftover_sample_indices)
    assert m["train/carried_groups"] == 0.0 and m["train/deferred_groups"] == 2.0
    assert [g.rollout_id for g in carry._groups] == [0, 1]


def test_group_id_collision_with_a_carried_group_is_an_error():
    carry = CarryBuffer()
    batch = carry.merge(0, _samples([7]), {"rewards": [1.0]})
    carry.defer(batch, [0])
    with pytest.raises(ValueError, match="group id 7 of rollout 1 collides with a carried group"):
        carry.merge(1, _samples([7]), {"rewards": [1.0]})


def test_values_must_align_with_samples():
    with pytest.raises(ValueError, match=r"values\['rewards'\] has 1 entries for 2 samples"):
        CarryBuffer().merge(0, _samples([0, 1]), {"rewards": [1.0]})


def test_state_dict_round_trip_keeps_samples_and_values():
    carry = CarryBuffer()
    batch = carry.merge(3, _samples([4, 4]), {"rewards": [0.25, 0.25]})
    carry.defer(batch, [0, 1])
    restored = CarryBuffer()
    restored.load_state_dict(carry.state_dict())
    assert restored.group_ids == [4]
    g = restored._groups[0]
    assert g.rollout_id == 3 and g.values == {"rewards": [0.25, 0.25]}
    assert [s.to_dict() for s in g.samples] == [s.to_dict() for s in carry._groups[0].samples]
