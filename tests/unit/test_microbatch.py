"""`MicroBatch` (slime/backends/megatron/microbatch.py): how a rank's train data is cut into micro-batches, what
hooks and losses receive of one (a plain dict, slime v0.3.0's `batch`), how log-prob passes regroup samples, and
how a postprocess hook's view of the rank's samples goes back into the micro-batches."""

from __future__ import annotations

import pytest

from slime.backends.megatron.microbatch import (
    MicroBatch,
    flat_fields,
    logprob_batches,
    microbatches,
    rollout_data_view,
    write_back,
)

pytestmark = pytest.mark.cpu


def rank_data(with_engine_log_probs: bool = True) -> dict:
    """Four samples in two micro-batches, the second holding samples 3 and 0 (schedule order is not data order)."""
    data = {
        "tokens": [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10, 11]],
        "total_lengths": [3, 2, 4, 2],
        "response_lengths": [1, 1, 2, 1],
        "loss_masks": [[1], [1], [1, 0], [1]],
        "group_mask_sums": [2.0, 2.0, 1.0, 1.0],
        "rewards": [0.5, 1.0, 0.0, 1.0],
        "sample_indices": [7, 8, 9, 10],
        "micro_batch_indices": [[1, 2], [3, 0]],
    }
    if with_engine_log_probs:
        data["rollout_log_probs"] = [[-0.1], [-0.2], [-0.3, -0.4], [-0.5]]
    return data


def test_micro_batches_follow_the_schedule_and_carry_only_what_the_rollout_sent():
    mbs = microbatches(rank_data())
    assert [mb.indices for mb in mbs] == [[1, 2], [3, 0]]
    assert mbs[1].tokens == [[10, 11], [1, 2, 3]] and mbs[1].rollout_log_probs == [[-0.5], [-0.1]]
    assert mbs[0].teacher_log_probs is None and mbs[0].log_probs is None  # not sent, not computed yet
    assert microbatches(rank_data(with_engine_log_probs=False))[0].rollout_log_probs is None


def test_hooks_receive_a_plain_dict_of_the_fields_set_so_far():
    mb = microbatches(rank_data())[0]
    mb.advantages, mb.returns = [[1.0], [2.0, 3.0]], [[0.0], [0.0, 0.0]]
    batch = mb.batch()
    assert type(batch) is dict
    assert set(batch) == {"tokens", "total_lengths", "response_lengths", "indices", "loss_masks", "group_mask_sums",
                          "rewards", "rollout_log_probs", "advantages", "returns"}  # fmt: skip
    assert batch["advantages"] is mb.advantages  # the same lists: what the loss reads is what the step set


def test_log_prob_batches_regroup_samples_under_a_token_cap_and_say_where_they_go_back():
    mbs = microbatches(rank_data())
    same = logprob_batches(mbs, None)
    assert [b for b, _ in same] == mbs and [t for _, t in same] == [[(0, 0), (0, 1)], [(1, 0), (1, 1)]]
    capped = logprob_batches(mbs, 6)  # 2 + 4 tokens, then 2 + 3
    assert [b.tokens for b, _ in capped] == [[[4, 5], [6, 7, 8, 9]], [[10, 11], [1, 2, 3]]]
    alone = logprob_batches(mbs, 3)  # a sample longer than the cap runs alone
    assert [b.total_lengths for b, _ in alone] == [[2], [4], [2], [3]]
    assert [t for _, t in alone] == [[(0, 0)], [(0, 1)], [(1, 0)], [(1, 1)]]


def test_flat_fields_span_the_rank_and_an_empty_rank_still_gets_every_field():
    mbs = microbatches(rank_data())
    mbs[0].values, mbs[1].values = ["v1", "v2"], ["v3", "v0"]
    flat = flat_fields(mbs, ("rewards", "values", "ref_log_probs"))
    assert flat == {"rewards": [1.0, 0.0, 1.0, 0.5], "values": ["v1", "v2", "v3", "v0"]}  # no reference: no key
    empty = [MicroBatch([], [], [])]
    assert flat_fields(empty, ("rewards", "ref_log_probs")) == {"rewards": [], "ref_log_probs": []}


def test_a_postprocess_hook_sees_data_order_and_what_it_writes_is_trained_on():
    data = rank_data()
    mbs = microbatches(data)
    for mb in mbs:
        mb.advantages = [[float(i)] for i in mb.indices]
    view = rollout_data_view(data, mbs)
    assert view["advantages"] == [[0.0], [1.0], [2.0], [3.0]] and view["sample_indices"] == [7, 8, 9, 10]
    assert "micro_batch_indices" not in view  # the schedule is not a per-sample list
    view["advantages"] = [[10.0], [11.0], [12.0], [13.0]]
    view["rewards"] = [9.0, 9.0, 9.0, 9.0]
    write_back(view, mbs, 4)
    assert mbs[1].advantages == [[13.0], [10.0]] and mbs[0].rewards == [9.0, 9.0]
    view["returns"] = [[0.0]]
    with pytest.raises(ValueError, match="'returns' has 1 entries, expected 4"):
        write_back(view, mbs, 4)
