"""`Sample` round-trips through dicts and JSON (rollout dumps), and folds SGLang's meta_info correctly."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slime.utils.types import Sample, Status
from tests.hypothesis_budget import examples

pytestmark = pytest.mark.cpu

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**31), 2**31), st.text(max_size=8))
samples = st.builds(
    Sample,
    group_index=st.one_of(st.none(), st.integers(0, 10**6)),
    index=st.one_of(st.none(), st.integers(0, 10**6)),
    group_id=st.one_of(st.none(), st.integers(0, 10**6)),
    prompt=st.one_of(
        st.text(max_size=20),
        st.lists(st.fixed_dictionaries({"role": st.text(max_size=5), "content": st.text(max_size=10)}), max_size=3),
    ),  # fmt: skip
    tokens=st.lists(st.integers(0, 50000), max_size=30),
    response=st.text(max_size=20),
    response_length=st.integers(0, 30),
    label=json_scalars,
    reward=st.one_of(st.none(), st.floats(allow_nan=False, allow_infinity=False, width=32)),
    loss_mask=st.one_of(st.none(), st.lists(st.integers(0, 1), max_size=30)),
    weight_versions=st.lists(st.text(max_size=4), max_size=3),
    rollout_log_probs=st.one_of(st.none(), st.lists(st.floats(-50, 0, width=32), max_size=30)),
    remove_sample=st.booleans(),
    status=st.sampled_from(list(Status)),
    metadata=st.dictionaries(st.text(max_size=5), json_scalars, max_size=4),
    session_id=st.one_of(st.none(), st.text(max_size=8)),
)


@settings(max_examples=examples(200), deadline=None)
@given(samples)
def test_round_trip_through_json(sample):
    d = json.loads(json.dumps(sample.to_dict()))
    assert Sample.from_dict(d) == sample
    assert Sample.from_dict(sample.to_dict()) == sample


def test_from_dict_rejects_unknown_fields():
    with pytest.raises(ValueError, match="unknown field"):
        Sample.from_dict({"tokens": [1], "rollout_idx": 3})


def test_update_from_meta_info_maps_finish_reasons(make_args: Callable[..., Any]):
    args = make_args()
    for finish, status in [
        ({"type": "length", "length": 8}, Status.TRUNCATED),
        ({"type": "stop", "matched": 2}, Status.COMPLETED),
        ({"type": "abort", "message": "x"}, Status.ABORTED),
    ]:
        s = Sample()
        s.update_from_meta_info(args, {"finish_reason": finish, "weight_version": 3, "cached_tokens": 4,
                                       "prompt_tokens": 10})  # fmt: skip
        assert s.status == status and s.weight_versions == ["3"]
        assert s.prefix_cache_info == {"cached_tokens": 4, "prompt_tokens": 10}


def test_reward_value_and_effective_length(make_args: Callable[..., Any]):
    assert Sample(reward={"acc": 1.0, "fmt": 0.5}).get_reward_value(make_args(reward_key="fmt")) == 0.5
    with pytest.raises(ValueError, match="--reward-key"):
        Sample(reward={"acc": 1.0}).get_reward_value(make_args(reward_key=None))
    assert Sample(response_length=5, loss_mask=[1, 0, 1, 1, 0]).effective_response_length == 3
    assert Sample(response_length=5).effective_response_length == 5
