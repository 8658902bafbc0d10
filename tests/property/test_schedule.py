"""Invariants of the step / micro-batch / DP schedule (slime.scheduling.schedule), for random inputs."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slime.scheduling import build_schedule
from slime.scheduling.packing import first_fit, karmarkar_karp, split_bins
from tests.hypothesis_budget import examples

pytestmark = pytest.mark.cpu


@st.composite
def schedule_case(draw):
    n_groups = draw(st.integers(1, 20))
    fan_out = [draw(st.integers(1, 4)) for _ in range(n_groups)]
    gids = draw(st.lists(st.integers(0, 10**6), min_size=n_groups, max_size=n_groups, unique=True))
    group_ids = [g for g, k in zip(gids, fan_out, strict=True) for _ in range(k)]
    # segments of one trajectory need not be adjacent in the rollout output
    group_ids = draw(st.permutations(group_ids))
    lengths = [draw(st.integers(1, 300)) for _ in group_ids]
    vpp = draw(st.sampled_from([1, 1, 2]))
    kw = dict(
        global_batch_size=draw(st.integers(1, n_groups + 2)),
        dp_size=draw(st.integers(1, 4)),
        cp_size=draw(st.integers(1, 2)),
        pp_size=draw(st.integers(1, 2)),
        vpp_size=vpp,
        microbatch_group_size_per_vp_stage=draw(st.sampled_from([None, 1, 2])),
        micro_batch_size=draw(st.integers(1, 3)),
        use_dynamic_batch_size=draw(st.booleans()),
        max_tokens_per_gpu=draw(st.integers(20, 400)),
        balance_data=draw(st.booleans()),
        allow_partial_last_step=draw(st.booleans()),
    )
    return lengths, group_ids, kw


def _first_occurrence(group_ids):
    return list(dict.fromkeys(group_ids))


@settings(max_examples=examples(300), deadline=None)
@given(schedule_case())
def test_schedule_invariants(case):
    lengths, group_ids, kw = case
    sched = build_schedule(lengths, group_ids, **kw)
    dp, B = kw["dp_size"], kw["global_batch_size"]
    mb_group = (kw["microbatch_group_size_per_vp_stage"] or kw["pp_size"]) if kw["vpp_size"] > 1 else 1
    cap = kw["max_tokens_per_gpu"] * kw["cp_size"]

    # every sample placed exactly once, either in a step or left over
    placed = [i for st_ in sched.steps for r in range(dp) for mb in st_.micro_batches[r] for i in mb]
    assert sorted(placed) == sorted(sched.scheduled_sample_indices)
    assert sorted(placed + sched.leftover_sample_indices) == list(range(len(lengths)))

    # groups in first-occurrence order, B per step, only the last may be partial (and only when allowed)
    order = _first_occurrence(group_ids)
    assert [g for s in sched.steps for g in s.group_ids] + sched.leftover_group_ids == order
    for k, s in enumerate(sched.steps):
        last = k == len(sched.steps) - 1
        assert s.global_batch_size == len(s.group_ids) == s.lr_increment
        assert s.global_batch_size == B or (last and kw["allow_partial_last_step"] and s.global_batch_size < B)
    if kw["allow_partial_last_step"]:
        assert sched.leftover_group_ids == []
    else:
        assert len(sched.leftover_group_ids) == len(order) % B

    # no group split across steps: each group's samples all sit in one step, and all of them
    step_of = {i: k for k, s in enumerate(sched.steps) for i in s.sample_indices}
    for g in order:
        members = [i for i, gg in enumerate(group_ids) if gg == g]
        if g in sched.leftover_group_ids:
            assert all(i not in step_of for i in members)
        else:
            assert len({step_of[i] for i in members}) == 1

    for s in sched.steps:
        n = len(s.sample_indices)
        # every rank runs the same count, a multiple of the VPP micro-batch group, all ranks together a multiple of dp
        assert all(len(s.micro_batches[r]) == s.num_microbatches for r in range(dp))
        assert s.num_microbatches % mb_group == 0 and s.num_microbatches >= 1
        mbs = [mb for r in range(dp) for mb in s.micro_batches[r]]
        empties = sum(1 for mb in mbs if not mb)
        for mb in mbs:
            if kw["use_dynamic_batch_size"]:
                # token cap, except a lone oversize sample
                assert sum(lengths[i] for i in mb) <= cap or len(mb) == 1
            else:
                assert len(mb) <= kw["micro_batch_size"]
        if empties:
            # empty micro-batches only when there are not enough samples/chunks to fill the slots
            filled = len(mbs) - empties
            if kw["use_dynamic_batch_size"]:
                assert filled == n
            else:
                assert filled == -(-n // kw["micro_batch_size"])
            assert empties < dp * mb_group

    # what ships to rank r: partitions[r] in execution order, micro_batch_indices local and tiling it
    for r in range(dp):
        flat = [j for mb in sched.micro_batch_indices[r] for j in mb]
        assert flat == list(range(len(sched.partitions[r])))
        expected = [mb for s in sched.steps for mb in s.micro_batches[r]]
        got = [[sched.partitions[r][j] for j in mb] for mb in sched.micro_batch_indices[r]]
        assert got == expected
    assert sum(sched.num_microbatches) * dp == sum(len(m) for m in sched.micro_batch_indices)


@settings(max_examples=examples(200), deadline=None)
@given(st.lists(st.integers(1, 100), min_size=1, max_size=40), st.integers(1, 150), st.integers(1, 50))
def test_first_fit_and_split_keep_the_cap(lengths, cap, extra):
    bins = first_fit(lengths, cap)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= cap or len(b) == 1 for b in bins)
    # first-fit bins can never be merged within the cap (why the schedule pads with empty micro-batches)
    loads = [sum(lengths[i] for i in b) for b in bins]
    assert all(loads[a] + loads[b] > cap for a in range(len(bins)) for b in range(a + 1, len(bins)))
    split = split_bins(bins, lengths, len(bins) + extra)
    assert sorted(i for b in split for i in b) == list(range(len(lengths)))
    assert len(split) == min(len(bins) + extra, len(lengths))
    assert all(b and (sum(lengths[i] for i in b) <= cap or len(b) == 1) for b in split)


@settings(max_examples=examples(200), deadline=None)
@given(st.integers(1, 5).flatmap(lambda k: st.tuples(st.just(k), st.integers(1, 6))), st.data())
def test_karmarkar_karp_equal_counts(kn, data):
    k, per = kn
    weights = data.draw(st.lists(st.integers(0, 1000), min_size=k * per, max_size=k * per))
    parts = karmarkar_karp(weights, k, equal_size=True)
    assert len(parts) == k and all(len(p) == per for p in parts)
    assert sorted(i for p in parts for i in p) == list(range(k * per))
    sums = [sum(weights[i] for i in p) for p in parts]
    # merging heaviest-with-lightest never widens the spread, so it is bounded by the widest initial
    # chunk of k consecutive sorted weights
    desc = sorted(weights, reverse=True)
    bound = max(desc[c] - desc[c + k - 1] for c in range(0, len(desc), k))
    assert max(sums) - min(sums) <= bound


def test_karmarkar_karp_known_case():
    w = [8, 7, 6, 5, 4, 3]
    parts = karmarkar_karp(w, 3)
    assert sorted(sum(w[i] for i in p) for p in parts) == [11, 11, 11]
