"""Weight buckets hand over exactly the sender's values, whichever way each tensor travels.

`flatten` copies strided sources into a flat bucket and `in_place_buckets` hands whole storages over with
metadata pointing into them; the receiver (`sim/fake_sglang/weights.py`) cuts the
views back out in one `split`. Both must give back the very bits of each source (NaN payloads and signed zeros
included), for any dtype, slicing and order.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.fake_sglang.weights import decode_payload
from slime.backends.megatron.weight_buckets import GatherPlan, flatten, in_place_buckets, new_buffer
from slime.backends.megatron.weight_sync import serialize
from tests.hypothesis_budget import examples

pytestmark = pytest.mark.cpu

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of `t`, so that NaN == NaN and -0.0 != 0.0."""
    return t.contiguous().view(-1).view(torch.uint8)


def _random_bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (int(torch.Size(shape).numel()) * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


@st.composite
def strided_views(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor]:
    """A non-contiguous view of a random-bits tensor (a column block of a grouped 3-D tensor, as q/k/v of a fused
    QKV are) and the values it must send."""
    dtype = draw(st.sampled_from(DTYPES))
    groups, rows, cols = draw(st.integers(1, 4)), draw(st.integers(2, 6)), draw(st.sampled_from([1, 3, 8, 16, 24]))
    base = _random_bits((groups, rows, cols), dtype, draw(st.integers(0, 2**31)))
    a = draw(st.integers(0, rows - 1))
    b = draw(st.integers(a + 1, rows))
    view = base[:, a:b]
    return view, view.contiguous()


@settings(max_examples=examples(200))
@given(st.lists(strided_views(), min_size=1, max_size=6))
def test_flatten_copies_strided_views_bit_for_bit(views):
    by_dtype: dict[torch.dtype, list] = {}
    for i, (view, want) in enumerate(views):
        by_dtype.setdefault(view.dtype, []).append((f"t{i}", view, want.shape, view.dtype))
    for bucket in by_dtype.values():
        flat, meta = flatten(bucket, new_buffer(bucket))
        for m, (_, view, _, _) in zip(meta, bucket, strict=True):
            assert torch.equal(_bits(flat[m.start_idx : m.end_idx]), _bits(view))


@settings(max_examples=examples(100))
@given(
    sizes=st.lists(st.integers(1, 40), min_size=1, max_size=12),
    gaps=st.lists(st.integers(0, 5), min_size=12, max_size=12),
    order=st.randoms(use_true_random=False),
    seed=st.integers(0, 2**31),
)
def test_in_place_buckets_decode_to_the_same_bits(sizes, gaps, order, seed):
    """Tensors laid in one shared storage with gaps, sent in any order: read in place, decoded back exactly; a
    strided view among them and a tensor in private memory go to the packed rest instead."""
    offsets, cursor = [], 0
    for n, gap in zip(sizes, gaps, strict=False):
        cursor += gap
        offsets.append(cursor)
        cursor += n
    storage = _random_bits((cursor + 7,), torch.bfloat16, seed).share_memory_()
    items = [(f"p{i}", storage[o : o + n]) for i, (o, n) in enumerate(zip(offsets, sizes, strict=True))]
    order.shuffle(items)
    half = (cursor + 7) // 2  # ≥ 4 elements: a strided view, never an empty (contiguous) one
    strided = ("strided", storage[: 2 * half].view(-1, 2)[:, 0], torch.Size([half]), torch.bfloat16)
    private = ("private", torch.ones(3, dtype=torch.bfloat16))
    in_place, rest = in_place_buckets([*items, strided, private])
    assert [r[0] for r in rest] == ["strided", "private"]
    assert len(in_place) == 1
    flat, meta, nbytes = in_place[0]
    assert flat.untyped_storage().data_ptr() == storage.untyped_storage().data_ptr()  # no copy was made
    assert nbytes == sum(sizes) * 2
    got = dict(decode_payload([serialize({"flattened_tensor": flat, "metadata": meta})], "flattened_bucket"))
    assert list(got) == [n for n, _ in items]
    for name, t in items:
        assert torch.equal(_bits(got[name]), _bits(t))


@st.composite
def views_of_one_storage(draw: st.DrawFn) -> tuple[torch.Tensor, list[tuple[str, torch.Tensor]]]:
    """Views of one random-bits storage, laid anywhere in it: column blocks of grouped 3-D blocks (q/k/v of a
    fused QKV), transposes (runs of one element), contiguous slices, size-1 dimensions."""
    dtype = draw(st.sampled_from(DTYPES))
    storage = _random_bits((4096,), dtype, draw(st.integers(0, 2**31)))
    views = []
    for i in range(draw(st.integers(1, 8))):
        kind = draw(st.sampled_from(["block", "transpose", "slice", "unit"]))
        g, r, c = draw(st.integers(1, 4)), draw(st.integers(1, 6)), draw(st.integers(1, 16))
        at = draw(st.integers(0, 4096 - g * r * c))
        base = storage[at : at + g * r * c]
        if kind == "block":
            a = draw(st.integers(0, r - 1))
            view = base.view(g, r, c)[:, a : draw(st.integers(a + 1, r))]
        elif kind == "transpose":
            view = base.view(g * r, c).t()
        elif kind == "slice":
            view = base
        else:
            view = base.view(g, 1, r * c)[:, :, : draw(st.integers(1, r * c))]
        views.append((f"t{i}", view))
    return storage, views


@settings(max_examples=examples(200))
@given(views_of_one_storage())
def test_gather_plan_packs_the_bits_flatten_packs(case):
    """A row gather per run length packs every view's row-major values, as a copy per view does."""
    storage, views = case
    plan = GatherPlan.of(views)
    assert plan is not None
    flat, meta = plan.pack()
    assert flat.untyped_storage().data_ptr() != storage.untyped_storage().data_ptr()  # a new bucket
    assert sorted(m.name for m in meta) == sorted(n for n, _ in views)
    got = dict(decode_payload([serialize({"flattened_tensor": flat, "metadata": meta})], "flattened_bucket"))
    for name, view in views:
        assert got[name].shape == view.shape
        assert torch.equal(_bits(got[name]), _bits(view))


def test_gather_plan_declines_what_it_cannot_or_should_not_pack():
    a, b = torch.zeros(8), torch.zeros(8)
    assert GatherPlan.of([("a", a), ("b", b)]) is None  # two storages
    assert GatherPlan.of([("a", a[:4], torch.Size([4]), torch.bfloat16)]) is None  # a cast
    assert GatherPlan.of([("a", a[:4]), ("empty", a[4:4])]) is None  # an empty tensor
    wide = torch.zeros(512, 1024)
    assert GatherPlan.of([("t", wide.t())]) is None  # runs of one element: a 4 MiB index for a 2 MiB tensor
    assert GatherPlan.of([("rows", wide[:, :512])]) is not None  # runs of 512: a 4 KiB index
