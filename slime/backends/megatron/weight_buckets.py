"""Weight buckets: the one way HF-named tensors are grouped and flattened for a transfer to the engines.

Why by dtype: a bucket travels as one flat tensor (SGLang's `flattened_bucket` load format), and tensors of one
dtype laid back to back stay aligned, so the receiver rebuilds each as a view of the flat buffer. Both weight
sync transports (CUDA IPC / shared memory, and the broadcast group) send these buckets.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class FlattenedTensorMetadata:
    """Field-for-field SGLang's `FlattenedTensorMetadata` (python/sglang/srt/weight_sync/tensor_bucket.py)."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


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
        self._plan: tuple[list[_Group], list[Item]] | None = None

    def split_in_place(self) -> tuple[list[tuple[torch.Tensor, list[Any], int]], list[Item]]:
        """`in_place_buckets(self)` with its Python (a pass over every view) done once: kept views never change
        storage, offset or shape, so a later sync only makes each storage's flat view again (its size is read
        anew: the offloader may have resized the storage in between)."""
        if self._plan is None or not all(shareable_in_place(g.source) for g in self._plan[0]):
            self._plan = _in_place_plan(self)
        groups, rest = self._plan
        return [(g.flat(), g.meta, g.nbytes) for g in groups], rest


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
        """A 1-D view of the whole storage, in the group's dtype."""
        storage = self.source.untyped_storage()
        size = (storage.nbytes() // self.dtype.itemsize,)
        return torch.empty(0, dtype=self.dtype, device=self.source.device).set_(storage, 0, size)


def _in_place_plan(items: Iterable[Item]) -> tuple[list[_Group], list[Item]]:
    groups: dict[int, _Group] = {}
    rest: list[Item] = []
    cls = _metadata_class()
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
        group.meta.append(cls(name, shape, dtype, start, start + shape.numel(), shape.numel()))
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


@functools.cache
def _metadata_class() -> type:
    """SGLang's own class where SGLang is installed: the payload is unpickled in the server, which must find the
    class by its module path. Without SGLang (CPU runs against the fake) the stand-in above travels instead."""
    try:
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata as cls
    except ImportError:
        return FlattenedTensorMetadata
    return cls


def flatten(bucket: list[Item], buffer: torch.Tensor | None = None) -> tuple[torch.Tensor, list[Any]]:
    """One 1-D tensor of the bucket's dtype holding every tensor back to back, and where each one lies.

    `buffer` (1-D, the bucket's dtype and device, large enough): the tensors are copied into its head, which is
    returned — one copy per tensor straight into its slot, strided views and dtype casts included (no
    intermediate copies), and no new allocation per bucket. Without it a new tensor is made."""
    specs = [_spec(item) for item in bucket]
    meta, start, cls = [], 0, _metadata_class()
    for name, _, shape, dtype in specs:
        meta.append(cls(name, shape, dtype, start, start + shape.numel(), shape.numel()))
        start += shape.numel()
    if buffer is None:
        dtype = specs[0][3]
        return torch.cat([t.detach().reshape(-1).to(dtype) for _, t, _, _ in specs]), meta
    flat = buffer[:start]
    slots = [flat[m.start_idx : m.end_idx].view(t.shape) for m, (_, t, _, _) in zip(meta, specs, strict=True)]
    torch._foreach_copy_(slots, [t.detach() for _, t, _, _ in specs])  # one grouped launch, not one per tensor
    return flat, meta


def bucket_nbytes(bucket: list[Item]) -> int:
    return sum(_nbytes(shape, dtype) for _, _, shape, dtype in map(_spec, bucket))


def new_buffer(bucket: list[Item]) -> torch.Tensor:
    """An empty 1-D tensor that `flatten` can fill with this bucket (its dtype, on its tensors' device)."""
    specs = [_spec(item) for item in bucket]
    return torch.empty(sum(shape.numel() for _, _, shape, _ in specs), dtype=specs[0][3], device=specs[0][1].device)
