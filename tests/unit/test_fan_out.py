"""Fan-out contract: validation errors (one line each) and `fan_out_sample_segments`."""

from __future__ import annotations

import pytest

from slime.agent.trajectory import TokenSegment, fan_out_sample_segments
from slime.algorithms.fan_out import assign_default_group_ids, flatten_samples, validate_fan_out
from slime.utils.errors import SlimeArgError
from slime.utils.types import Sample, Status

pytestmark = pytest.mark.cpu


def S(index, group_id=None):
    return Sample(index=index, group_id=group_id, group_index=0)


def test_valid_outputs_pass():
    validate_fan_out([[S(0), S(1)], [S(2), S(3)]])  # plain prompt x trajectory
    validate_fan_out([[[S(0, 0), S(0, 0)], S(1)], [[S(2, 9)], [S(3, 3), S(3, 3), S(3, 3)]]])  # mixed depths


def test_siblings_with_different_group_ids():
    with pytest.raises(SlimeArgError, match=r"siblings at output\[0\]\[1\] have different group ids \[1, 2\]") as e:
        validate_fan_out([[S(0), [S(1, 1), S(1, 2)]]])
    assert "\n" not in str(e.value)


def test_group_id_missing():
    with pytest.raises(SlimeArgError, match=r"output\[1\]\[0\] returns 2 samples but sample 1 has no group_id") as e:
        validate_fan_out([[S(0)], [[S(1, 5), S(1)]]])
    assert "\n" not in str(e.value)


def test_group_id_shared_by_two_trajectories():
    with pytest.raises(SlimeArgError, match=r"group id 4 is used by two trajectories") as e:
        validate_fan_out([[[S(0, 4), S(0, 4)], S(4)]])
    assert "\n" not in str(e.value)


def test_flatten_and_default_group_ids():
    out = [[S(0), [S(1, 7), S(1, 7)]]]
    samples = flatten_samples(out)
    assert [s.index for s in samples] == [0, 1, 1]
    assign_default_group_ids(samples)
    assert [s.group_id for s in samples] == [0, 7, 7]
    with pytest.raises(SlimeArgError, match="neither group_id nor index"):
        assign_default_group_ids([Sample()])


def _segments():
    return [
        TokenSegment(prompt_ids=[1, 2], response_ids=[3, 4, 5], loss_mask=[1, 0, 1], metadata={"kind": "pre"}),
        TokenSegment(prompt_ids=[9], response_ids=[6], rollout_log_probs=[-0.5], metadata={"kind": "post"}),
    ]


def test_fan_out_full_reward_is_the_default():
    base = Sample(index=11, group_index=3, metadata={"dataset": "d"}, teacher_log_probs=[0.0] * 5)
    out = fan_out_sample_segments(base, _segments(), 2.0)
    assert out[0] is base and out[1] is not base
    assert [s.group_id for s in out] == [11, 11] and [s.group_index for s in out] == [3, 3]
    assert [s.reward for s in out] == [2.0, 2.0]
    assert [s.metadata["segment_idx"] for s in out] == [0, 1]
    assert all(s.metadata["num_segments"] == 2 and s.metadata["dataset"] == "d" for s in out)
    assert [s.metadata["kind"] for s in out] == ["pre", "post"]
    assert out[0].tokens == [1, 2, 3, 4, 5] and out[0].response_length == 3 and out[0].loss_mask == [1, 0, 1]
    assert out[1].tokens == [9, 6] and out[1].loss_mask == [1] and out[1].rollout_log_probs == [-0.5]
    assert all(s.status == Status.COMPLETED and s.teacher_log_probs is None for s in out)
    assert out[0].metadata is not out[1].metadata and out[0].weight_versions is not out[1].weight_versions
    validate_fan_out([[out]])


def test_fan_out_split_reward_and_explicit_group_id():
    base = Sample(index=11, group_id=40)
    out = fan_out_sample_segments(base, _segments(), 3.0, mode="split", metadata={"agent": "sub"})
    assert [s.reward for s in out] == [1.5, 1.5] and [s.group_id for s in out] == [40, 40]
    assert all(s.metadata["agent"] == "sub" for s in out)


def test_fan_out_argument_errors():
    with pytest.raises(ValueError, match="--fan-out-reward must be one of"):
        fan_out_sample_segments(Sample(index=0), _segments(), 1.0, mode="half")
    with pytest.raises(ValueError, match="at least one segment"):
        fan_out_sample_segments(Sample(index=0), [], 1.0)
    with pytest.raises(ValueError, match="neither group_id nor index"):
        fan_out_sample_segments(Sample(), _segments(), 1.0)
    with pytest.raises(ValueError, match="loss_mask has 1 entries for 2 response tokens"):
        fan_out_sample_segments(Sample(index=0), [TokenSegment([1], [2, 3], loss_mask=[1])], 1.0)
