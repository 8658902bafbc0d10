"""Zigzag CP slicing: round trips, response-range partition, packed micro-batches, CP-additive loss sums."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from slime.algorithms.cp_slicing import (
    cp_pad_len,
    response_ranges_for_cp,
    slice_for_cp,
    slice_packed_for_cp,
    slice_response_for_cp,
    unslice_from_cp,
    unslice_packed_from_cp,
    unslice_response_from_cp,
    zigzag_chunk_ranges,
)

pytestmark = pytest.mark.cpu

N_EXAMPLES = settings().max_examples  # from the profile: 200 under CI=true (tests/hypothesis_budget.py)
cp_sizes = st.integers(1, 8)


@settings(max_examples=N_EXAMPLES, deadline=None)
@given(
    total_len=st.integers(0, 200),
    cp=cp_sizes,
    extra=st.lists(st.integers(1, 3), max_size=2),
    dim_pick=st.integers(0, 2),
    seed=st.integers(0, 2**16),
)
def test_slice_round_trips_along_any_dim(total_len, cp, extra, dim_pick, seed):
    dim = dim_pick % (len(extra) + 1)
    shape = list(extra)
    shape.insert(dim, total_len)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    parts = [slice_for_cp(x, cp, r, dim=dim) for r in range(cp)]
    assert all(p.shape[dim] == cp_pad_len(total_len, cp) // cp for p in parts)
    assert torch.equal(unslice_from_cp(parts, total_len, cp, dim=dim), x)
    # negative dims address the same axis
    assert torch.equal(slice_for_cp(x, cp, cp - 1, dim=dim - len(shape)), parts[-1])


@settings(max_examples=N_EXAMPLES, deadline=None)
@given(total_len=st.integers(0, 500), cp=cp_sizes)
def test_chunks_tile_the_padded_sequence_zigzag(total_len, cp):
    padded = cp_pad_len(total_len, cp)
    assert padded % (2 * cp) == 0 and total_len <= padded < total_len + 2 * cp
    covered = []
    for r in range(cp):
        (a, b), (c, d) = zigzag_chunk_ranges(total_len, cp, r)
        assert b - a == d - c == padded // (2 * cp)
        # rank r's chunks are r and 2cp-1-r: the first rank gets the cheapest and the most expensive chunk
        assert a == r * (b - a) and c == (2 * cp - 1 - r) * (b - a)
        covered += list(range(a, b)) + list(range(c, d))
    assert sorted(covered) == list(range(padded))


@settings(max_examples=N_EXAMPLES, deadline=None)
@given(prompt_len=st.integers(1, 120), response_len=st.integers(0, 120), cp=cp_sizes)
def test_response_ranges_partition_and_follow_predicting_positions(prompt_len, response_len, cp):
    total_len = prompt_len + response_len
    owner = {}
    for r in range(cp):
        chunks = zigzag_chunk_ranges(total_len, cp, r)
        for s, e in response_ranges_for_cp(total_len, response_len, cp, r):
            assert 0 <= s < e <= response_len
            for j in range(s, e):
                assert j not in owner, "overlap"
                owner[j] = r
                pos = prompt_len - 1 + j  # logits at pos predict token pos+1 = response token j
                assert any(a <= pos < b for a, b in chunks)
    assert sorted(owner) == list(range(response_len))


@settings(max_examples=N_EXAMPLES, deadline=None)
@given(
    prompt_len=st.integers(1, 80),
    response_len=st.integers(0, 80),
    cp=cp_sizes,
    denom=st.integers(1, 500),
    seed=st.integers(0, 2**16),
)
def test_response_slices_round_trip_and_cp_local_sums_add_up(prompt_len, response_len, cp, denom, seed):
    total_len = prompt_len + response_len
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(response_len, dtype=torch.float64, generator=g)
    mask = (torch.rand(response_len, generator=g) > 0.3).to(torch.float64)
    xs = [slice_response_for_cp(x, total_len, response_len, cp, r) for r in range(cp)]
    ms = [slice_response_for_cp(mask, total_len, response_len, cp, r) for r in range(cp)]
    assert torch.equal(unslice_response_from_cp(xs, total_len, response_len, cp), x)
    # The reducer's contract: CP-local masked sums over a *global* denominator add up to the full value.
    local = sum(float((xr * mr).sum()) / denom for xr, mr in zip(xs, ms, strict=True))
    assert local == pytest.approx(float((x * mask).sum()) / denom, rel=1e-9, abs=1e-12)


@st.composite
def packed_batches(draw):
    lengths = draw(st.lists(st.integers(0, 40), min_size=1, max_size=6))
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return lengths, cu


@settings(max_examples=N_EXAMPLES, deadline=None)
@given(batch=packed_batches(), cp=cp_sizes, hidden=st.integers(0, 3), as_tensor=st.booleans())
def test_packed_round_trip(batch, cp, hidden, as_tensor):
    lengths, cu = batch
    shape = (cu[-1], hidden) if hidden else (cu[-1],)
    tokens = torch.arange(cu[-1] * max(hidden, 1)).reshape(shape) + 1  # 0 is the pad value
    cu_arg = torch.tensor(cu, dtype=torch.int32) if as_tensor else cu
    parts, padded_cus = zip(*(slice_packed_for_cp(tokens, cu_arg, cp, r) for r in range(cp)), strict=True)
    expected_cu = [0]
    for n in lengths:
        expected_cu.append(expected_cu[-1] + cp_pad_len(n, cp))
    for r, (part, pcu) in enumerate(zip(parts, padded_cus, strict=True)):
        assert pcu.tolist() == expected_cu  # the padded full-sequence boundaries PackedSeqParams takes
        assert part.shape[0] * cp == expected_cu[-1]
        # each sample is sliced on its own, in order
        local_cu = [c // cp for c in expected_cu]
        for i in range(len(lengths)):
            sample = tokens[cu[i] : cu[i + 1]]
            assert torch.equal(part[local_cu[i] : local_cu[i + 1]], slice_for_cp(sample, cp, r))
    assert torch.equal(unslice_packed_from_cp(list(parts), cu_arg, cp), tokens)


def test_worked_example():
    # 10 tokens, cp=2: padded to 12, chunks of 3; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
    x = torch.arange(10)
    assert zigzag_chunk_ranges(10, 2, 0) == [(0, 3), (9, 12)]
    assert slice_for_cp(x, 2, 0).tolist() == [0, 1, 2, 9, 0, 0]
    assert slice_for_cp(x, 2, 1).tolist() == [3, 4, 5, 6, 7, 8]
    # prompt 4, response 6: response token j is predicted at position 3+j (positions 3..8).
    assert response_ranges_for_cp(10, 6, 2, 0) == []
    assert response_ranges_for_cp(10, 6, 2, 1) == [(0, 3), (3, 6)]
    assert response_ranges_for_cp(10, 7, 2, 0) == [(0, 1)]


def test_invalid_inputs_raise():
    with pytest.raises(ValueError, match="out of range"):
        slice_for_cp(torch.ones(4), 2, 2)
    with pytest.raises(ValueError, match="prompt token"):
        response_ranges_for_cp(5, 5, 2, 0)
    with pytest.raises(ValueError, match="expected 2 CP parts"):
        unslice_from_cp([torch.ones(2)], 2, 2)
    with pytest.raises(ValueError, match="cover"):
        slice_packed_for_cp(torch.ones(5), [0, 2, 4], 2, 0)
