"""`weight_buckets.copy_tensors`: the sync's copy (large tensors one by one, small ones grouped) copies every
tensor exactly, whatever mix of sizes, strides and order it gets."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from slime.backends.megatron import weight_buckets
from slime.backends.megatron.weight_buckets import copy_tensors

pytestmark = pytest.mark.cpu

shapes = st.lists(
    st.tuples(st.integers(1, 40), st.integers(1, 40), st.booleans()),  # rows, cols, strided (a transposed view)
    min_size=1,
    max_size=12,
)


@settings(max_examples=150, deadline=None)
@given(shapes=shapes, threshold=st.sampled_from([1, 64, 1024, 1 << 20]), seed=st.integers(0, 2**16))
def test_copy_tensors_copies_every_tensor(shapes: list[tuple[int, int, bool]], threshold: int, seed: int) -> None:
    # the threshold decides which tensors go one by one; every split must give the same result
    saved, weight_buckets.LARGE_COPY_BYTES = weight_buckets.LARGE_COPY_BYTES, threshold
    try:
        _check(shapes, seed)
    finally:
        weight_buckets.LARGE_COPY_BYTES = saved


def _check(shapes: list[tuple[int, int, bool]], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    src = [
        torch.randn(c, r, generator=g).t() if strided else torch.randn(r, c, generator=g) for r, c, strided in shapes
    ]
    flat = torch.full((sum(s.numel() for s in src),), float("nan"))
    dst, at = [], 0
    for s in src:  # slots of one flat buffer, as `flatten` makes them
        dst.append(flat[at : at + s.numel()].view(s.shape))
        at += s.numel()
    copy_tensors(dst, src)
    assert all(torch.equal(d, s) for d, s in zip(dst, src, strict=True))
    assert not torch.isnan(flat).any()  # every slot written, none skipped
