"""Invariants of the step / micro-batch / DP schedule (slime.scheduling.schedule), for random inputs."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slime.scheduling import build_schedule
from slime.scheduling.packing import first_fit, karmarkar_karp, packed_load, split_bins

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


@settings(max_examples=300, deadline=None)
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


@settings(max_examples=200, deadline=None)
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


@settings(max_examples=200, deadline=None)
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


@st.composite
def shared_prompt_case(draw):
    """Samples as token lists: most take their prompt from a small pool (GRPO siblings, agent turns that repeat a
    context), some have none; the schedule is told the prompts as the trainer's packer will share them."""
    pool = draw(st.lists(st.lists(st.integers(1, 50), min_size=1, max_size=120), min_size=1, max_size=4))
    n = draw(st.integers(1, 40))
    tokens, prompt_lengths = [], []
    for _ in range(n):
        k = draw(st.integers(-1, len(pool) - 1))
        prompt = pool[k] if k >= 0 else []
        tokens.append(prompt + draw(st.lists(st.integers(1, 50), min_size=1, max_size=80)))
        prompt_lengths.append(len(prompt))
    group_ids = [draw(st.integers(0, 6)) for _ in range(n)]
    kw = dict(
        global_batch_size=draw(st.integers(1, 4)),
        dp_size=draw(st.integers(1, 3)),
        use_dynamic_batch_size=True,
        max_tokens_per_gpu=draw(st.integers(20, 600)),
        balance_data=draw(st.booleans()),
        allow_partial_last_step=True,
    )
    return tokens, prompt_lengths, group_ids, kw


@settings(max_examples=300, deadline=None)
@given(shared_prompt_case())
def test_shared_prompt_schedule_keeps_the_packed_cap(case):
    """The cap holds for the row the trainer really builds (megatron packer, counted independently of the
    schedule's own load), and every sample is placed once."""
    from slime.backends.megatron.packing import pack_samples

    tokens, prompt_lengths, group_ids, kw = case
    lengths = [len(t) for t in tokens]
    prompts = [(tuple(t[:p]), p) if p else None for t, p in zip(tokens, prompt_lengths, strict=True)]
    sched = build_schedule(lengths, group_ids, prompts=prompts, **kw)
    cap = kw["max_tokens_per_gpu"]
    placed = [i for s in sched.steps for r in range(kw["dp_size"]) for mb in s.micro_batches[r] for i in mb]
    assert sorted(placed) == list(range(len(tokens)))
    for s in sched.steps:
        for mb in (mb for r in range(kw["dp_size"]) for mb in s.micro_batches[r] if mb):
            row = pack_samples([tokens[i] for i in mb], prompt_lengths=[prompt_lengths[i] for i in mb])
            assert row.tokens.numel() - row.pad == packed_load(mb, lengths, prompts)
            assert row.tokens.numel() - row.pad <= cap or len(mb) == 1


@settings(max_examples=200, deadline=None)
@given(shared_prompt_case(), st.integers(1, 30))
def test_first_fit_and_split_with_prompts(case, extra):
    tokens, prompt_lengths, _, kw = case
    lengths = [len(t) for t in tokens]
    prompts = [(tuple(t[:p]), p) if p else None for t, p in zip(tokens, prompt_lengths, strict=True)]
    cap = kw["max_tokens_per_gpu"]
    bins = first_fit(lengths, cap, prompts)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(packed_load(b, lengths, prompts) <= cap or len(b) == 1 for b in bins)
    split = split_bins(bins, lengths, len(bins) + extra, prompts)
    assert sorted(i for b in split for i in b) == list(range(len(lengths)))
    assert len(split) == min(len(bins) + extra, len(lengths))
    assert all(b and (packed_load(b, lengths, prompts) <= cap or len(b) == 1) for b in split)


def test_grpo_prompts_fill_micro_batches_by_packed_tokens():
    """4 prompts of 100 tokens x 8 responses of 20, cap 500: counted per sample (120) a micro-batch holds 4
    samples, so 8 micro-batches; counted as packed, 3. By hand: bin 1 takes prompt 0's eight (260) and seven of
    prompt 1 (500); bin 2 the last of prompt 1 (120), prompt 2's eight (380) and the first of prompt 3 (500);
    bin 3 the other seven of prompt 3 (240)."""
    lengths = [120] * 32
    prompts = [((g,) * 100, 100) for g in range(4) for _ in range(8)]
    plain = first_fit(lengths, 500)
    shared = first_fit(lengths, 500, prompts)
    assert len(plain) == 8
    assert [len(b) for b in shared] == [15, 10, 7]
    assert [packed_load(b, lengths, prompts) for b in shared] == [500, 500, 240]
    # splitting a bin that holds several prompts keeps each prompt's siblings together
    halves = split_bins(shared[:1], lengths, 2, prompts)
    assert [sorted({prompts[i][0][0] for i in h}) for h in halves] == [[0], [1]]


def test_schedule_from_args_shares_prompts_only_with_the_flag():
    """`build_schedule_from_args` tells the schedule the prompts exactly when `--share-prompt-prefix` is on;
    siblings of one prompt get one identity, different prompts (or lengths) different ones, none for no prompt."""
    import types

    from slime.scheduling import build_schedule_from_args
    from slime.scheduling.schedule import sample_prompts
    from slime.utils.types import Sample

    prompts = [[7] * 90, [8] * 90, [7] * 89]
    samples = [
        Sample(index=g, group_id=g * 4 + k, tokens=prompts[g] + [1] * 10, response_length=10)
        for g in range(3)
        for k in range(4)
    ] + [Sample(index=3, group_id=99, tokens=[5] * 20, response_length=20)]
    keys = sample_prompts(samples)
    assert keys[-1] is None
    assert len({keys[i] for i in range(4)}) == 1 and keys[0][1] == 90
    assert len({k[0] for k in keys[:-1]}) == 3  # same tokens but shorter, or other tokens: other prompts
    args = types.SimpleNamespace(
        global_batch_size=13, micro_batch_size=1, use_dynamic_batch_size=True, max_tokens_per_gpu=400,
        balance_data=False, allow_partial_last_step=False, share_prompt_prefix=False,
    )  # fmt: skip
    plain = build_schedule_from_args(args, samples, {"dp_size": 1, "cp_size": 1})
    args.share_prompt_prefix = True
    shared = build_schedule_from_args(args, samples, {"dp_size": 1, "cp_size": 1})
    assert plain.num_microbatches == [4]  # 12 samples of 100, 4 per micro-batch, then the 20-token one
    # packed, the three prompts and their 4 branches each fit one micro-batch: 130 + 130 + (89 + 40); the
    # 20-token sample would make it 409
    assert shared.num_microbatches == [2]
    lengths = [len(s.tokens) for s in samples]
    assert [packed_load(mb, lengths, keys) for mb in shared.steps[0].micro_batches[0]] == [389, 20]
