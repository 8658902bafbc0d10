"""Weight buckets: the one way HF-named tensors are grouped and flattened for a transfer to the engines.

Why by dtype: a bucket travels as one flat tensor (SGLang's `flattened_bucket` load format), and tensors of one
dtype laid back to back stay aligned, so the receiver rebuilds each as a view of the flat buffer. Both weight
sync transports (CUDA IPC / shared memory, and the broadcast group) send these buckets.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch


def tensor_metadata(
    name: str, shape: torch.Size, dtype: torch.dtype, start_idx: int, end_idx: int, numel: int
) -> SimpleNamespace:
    """Where one tensor lies in a flat bucket: the fields of SGLang's `FlattenedTensorMetadata`
    (python/sglang/srt/weight_sync/tensor_bucket.py), which the engine reads as attributes.

    Why a `types.SimpleNamespace` and not SGLang's class: the payload is unpickled by SGLang's `SafeUnpickler`
    (python/sglang/srt/utils/common.py), which admits `types.SimpleNamespace` in every release slime speaks (0.5.14-
    0.5.20 admit the `types.` module, 0.5.21+ list the class) but no class of slime's, and the trainer has no SGLang
    to import."""
    return SimpleNamespace(name=name, shape=shape, dtype=dtype, start_idx=start_idx, end_idx=end_idx, numel=numel)


Item = tuple[str, torch.Tensor] | tuple[str, torch.Tensor, torch.Size, torch.dtype]
"""A tensor to send: (HF name, tensor), or (HF name, values, HF shape, dtype to send) where the values hold the
tensor in row-major order under another shape (a strided view, `hf_weights.iter_hf_sources`) or dtype."""


def _spec(item: Item) -> tuple[str, torch.Tensor, torch.Size, torch.dtype]:
    if len(item) == 2:
        name, t = item
        return name, t, t.shape, t.dtype
    return item  # type: ignore[return-value]


def _nbytes(shape: torch.Size, dtype: torch.dtype) -> int:
    return shape.numel() * dtype.itemsize


class LiveWeights(list):
    """Items that are views of a trainer's live parameters (`MegatronTrainer.weights_for_sync`), whose storages
    stay allocated and unchanged until the sync returns. With `hand_over`, a sync hands those storages over where
    they lie (`in_place_buckets`) instead of copying them into buckets. Set it only where the storages are freed
    after each sync (the offloader releases the params): torch wraps a CUDA storage in one more layer of its IPC
    reference counting (a counter slot and an event) at every hand-over, until the storage's memory is freed."""

    def __init__(self, items: Iterable[Item] = (), hand_over: bool = False) -> None:
        super().__init__(items)
        self.hand_over = hand_over
        self._plans: dict[int, tuple[list[_Group], list[tuple[list[Item], GatherPlan | None]]]] = {}

    def plan(self, bucket_bytes: int) -> tuple[list[_Group], list[tuple[list[Item], GatherPlan | None]]]:
        """How a sync sends these views, worked out once per bucket size (kept views never change storage,
        offset or shape; a pass over hundreds of them in Python costs ~1 ms a sync): the storages read in place
        (with `hand_over`; `_Group.flat` reads each storage's size anew, the offloader may resize it) and the
        buckets to pack, each with its `GatherPlan` where one can pack it."""
        cached = self._plans.get(bucket_bytes)
        if cached is None or not all(shareable_in_place(g.source) for g in cached[0]):
            groups, rest = _in_place_plan(self) if self.hand_over else ([], list(self))
            cached = groups, [(b, GatherPlan.of(b)) for b in buckets_by_dtype(rest, bucket_bytes)]
            self._plans[bucket_bytes] = cached
        return cached


def shareable_in_place(t: torch.Tensor) -> bool:
    """Can the engines read `t`'s storage without it moving? CUDA memory can (a CUDA IPC handle to it); host memory
    only if it is already shared memory (pickling a private host storage would move it to shared memory, and a
    shared storage can no longer be resized, which the offloader's release of the params does)."""
    return t.is_cuda or t.untyped_storage().is_shared()


@dataclass
class _Group:
    """Items read in place from one storage: `source` is one of them (its storage is the group's)."""

    source: torch.Tensor
    dtype: torch.dtype
    meta: list[Any]
    nbytes: int

    def flat(self) -> torch.Tensor:
        return _whole_storage(self.source, self.dtype)


def _whole_storage(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D view of all of `t`'s storage in `dtype`, its size read now (the offloader may have resized it)."""
    storage = t.untyped_storage()
    return torch.empty(0, dtype=dtype, device=t.device).set_(storage, 0, (storage.nbytes() // dtype.itemsize,))


def _in_place_plan(items: Iterable[Item]) -> tuple[list[_Group], list[Item]]:
    groups: dict[int, _Group] = {}
    rest: list[Item] = []
    for item in items:
        name, t, shape, dtype = _spec(item)
        storage = t.untyped_storage()
        key = storage.data_ptr()
        fits = t.dtype == dtype and t.is_contiguous() and storage.nbytes() % dtype.itemsize == 0
        if not (fits and shareable_in_place(t)) or (key in groups and groups[key].dtype != dtype):
            rest.append(item)
            continue
        group = groups.setdefault(key, _Group(t, dtype, [], 0))
        start = t.storage_offset()
        group.meta.append(tensor_metadata(name, shape, dtype, start, start + shape.numel(), shape.numel()))
        group.nbytes += _nbytes(shape, dtype)
    return list(groups.values()), rest


def in_place_buckets(items: Iterable[Item]) -> tuple[list[tuple[torch.Tensor, list[Any], int]], list[Item]]:
    """Split `items` into buckets read in place and the rest: (flat, metadata, bytes) per storage for the items
    that are contiguous, already in the dtype to send and in a storage `shareable_in_place` — `flat` is a 1-D view
    of that whole storage and each metadata entry points at one item in it (SGLang's flattened-bucket format
    takes any start and end, gaps allowed) — and the items that must be copied into buckets (strided views such as
    q/k/v of a fused QKV, casts, private host memory).

    Why: the copy into a bucket moves every byte once more than the hand-off needs; for the kept views of a
    trainer without TP gathers that is ~85% of the bytes (all but q/k/v)."""
    groups, rest = _in_place_plan(items)
    return [(g.flat(), g.meta, g.nbytes) for g in groups], rest


def buckets_by_dtype(named_tensors: Iterable[Item], bucket_bytes: int) -> Iterator[list[Item]]:
    """Lists of same-dtype tensors of at most `bucket_bytes` each (a larger tensor travels alone), in order of
    completion; tensors are not copied."""
    pending: dict[torch.dtype, list[Item]] = {}
    sizes: dict[torch.dtype, int] = {}
    for item in named_tensors:
        _, _, shape, dtype = _spec(item)
        nbytes = _nbytes(shape, dtype)
        if dtype in pending and sizes[dtype] + nbytes > bucket_bytes:
            yield pending.pop(dtype)
            sizes.pop(dtype)
        pending.setdefault(dtype, []).append(item)
        sizes[dtype] = sizes.get(dtype, 0) + nbytes
    yield from pending.values()


def flatten(bucket: list[Item], buffer: torch.Tensor | None = None) -> tuple[torch.Tensor, list[Any]]:
    """One 1-D tensor of the bucket's dtype holding every tensor back to back, and where each one lies.

    `buffer` (1-D, the bucket's dtype and device, large enough): the tensors are copied into its head, which is
    returned — one copy per tensor straight into its slot, strided views and dtype casts included (no
    intermediate copies), and no new allocation per bucket. Without it a new tensor is made."""
    specs = [_spec(item) for item in bucket]
    meta, start = [], 0
    for name, _, shape, dtype in specs:
        meta.append(tensor_metadata(name, shape, dtype, start, start + shape.numel(), shape.numel()))
        start += shape.numel()
    if buffer is None:
        dtype = specs[0][3]
        return torch.cat([t.detach().reshape(-1).to(dtype) for _, t, _, _ in specs]), meta
    flat = buffer[:start]
    slots = [flat[m.start_idx : m.end_idx].view(t.shape) for m, (_, t, _, _) in zip(meta, specs, strict=True)]
    torch._foreach_copy_(slots, [t.detach() for _, t, _, _ in specs])  # one grouped launch, not one per tensor
    return flat, meta


def _runs(t: torch.Tensor) -> tuple[int, torch.Tensor]:
    """`t`'s elements in row-major order as runs contiguous in its storage: (run length, each run's start)."""
    run, dims = 1, len(t.shape)
    while dims and (t.stride(dims - 1) == run or t.shape[dims - 1] == 1):
        run *= t.shape[dims - 1]
        dims -= 1
    starts = torch.tensor([t.storage_offset()], dtype=torch.int64)
    for size, stride in zip(t.shape[:dims], t.stride()[:dims], strict=True):
        starts = (starts[:, None] + torch.arange(size, dtype=torch.int64) * stride).reshape(-1)
    return run, starts


@dataclass
class GatherPlan:
    """A bucket of strided views of one storage, packed by one row gather per run length instead of a copy per
    tensor: q/k/v of every fused QKV are runs of whole heads (`hf_weights.qkv_views`), a few thousand rows in
    all. Why: a copy per tensor costs ~10 us of launch and dispatch on the host (hundreds per sync), and the
    strided ones ran at a third of the speed (the 604 MB of q/k/v of a 1.8B model: 2.9 ms against 1.0 ms,
    docs/performance.md)."""

    source: torch.Tensor  # one of the bucket's tensors: the storage every run is read from
    dtype: torch.dtype
    meta: list[Any]  # where each tensor lies in the packed bucket (grouped by run length, not in bucket order)
    gathers: list[tuple[int, int, torch.Tensor]]  # (run length, where its rows start in the bucket, row starts)
    numel: int

    @classmethod
    def of(cls, bucket: list[Item]) -> GatherPlan | None:
        """The plan, or None where a gather cannot pack this bucket (tensors of several storages, a dtype cast, an
        empty tensor) or should not: runs so short (a transposed weight: one element each) that the index of row
        starts would outweigh the copies it saves (over 1 MiB and over 1/16 of the bucket's bytes)."""
        specs = [_spec(item) for item in bucket]
        _, first, _, dtype = specs[0]
        key = first.untyped_storage().data_ptr()
        if any(t.dtype != dtype or t.untyped_storage().data_ptr() != key or t.numel() == 0 for _, t, _, _ in specs):
            return None
        by_run: dict[int, list[tuple[str, torch.Size, torch.Tensor]]] = {}
        for name, t, shape, _ in specs:
            run, starts = _runs(t)
            by_run.setdefault(run, []).append((name, shape, starts))
        index_bytes = 8 * sum(starts.numel() for members in by_run.values() for _, _, starts in members)
        if index_bytes > max(1 << 20, bucket_nbytes(bucket) // 16):
            return None
        meta, gathers, cursor = [], [], 0
        for run, members in by_run.items():
            rows = torch.cat([starts for _, _, starts in members])
            gathers.append((run, cursor, rows.pin_memory() if first.is_cuda else rows))  # pinned: uploads async
            for name, shape, _ in members:
                meta.append(tensor_metadata(name, shape, dtype, cursor, cursor + shape.numel(), shape.numel()))
                cursor += shape.numel()
        return cls(first, dtype, meta, gathers, cursor)

    def pack(self) -> tuple[torch.Tensor, list[Any]]:
        """A new flat tensor holding the bucket (`flatten`'s result, in the plan's order)."""
        whole = _whole_storage(self.source, self.dtype)
        flat = torch.empty(self.numel, dtype=self.dtype, device=self.source.device)
        for run, at, starts in self.gathers:
            rows = starts.to(flat.device, non_blocking=True)
            # every window of `run` elements of the storage is a row of this view: the gather reads whole runs
            torch.index_select(whole.unfold(0, run, 1), 0, rows, out=flat[at : at + rows.numel() * run].view(-1, run))
        return flat, self.meta


def bucket_nbytes(bucket: list[Item]) -> int:
    return sum(_nbytes(shape, dtype) for _, _, shape, dtype in map(_spec, bucket))


def new_buffer(bucket: list[Item]) -> torch.Tensor:
    """An empty 1-D tensor that `flatten` can fill with this bucket (its dtype, on its tensors' device)."""
    specs = [_spec(item) for item in bucket]
    return torch.empty(sum(shape.numel() for _, _, shape, _ in specs), dtype=specs[0][3], device=specs[0][1].device)
