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


def buckets_by_dtype(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Lists of same-dtype tensors of at most `bucket_bytes` each (a larger tensor travels alone), in order of
    completion; tensors are not copied."""
    pending: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
    sizes: dict[torch.dtype, int] = {}
    for name, t in named_tensors:
        nbytes = t.numel() * t.element_size()
        if t.dtype in pending and sizes[t.dtype] + nbytes > bucket_bytes:
            yield pending.pop(t.dtype)
            sizes.pop(t.dtype)
        pending.setdefault(t.dtype, []).append((name, t))
        sizes[t.dtype] = sizes.get(t.dtype, 0) + nbytes
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


def flatten(
    bucket: list[tuple[str, torch.Tensor]], buffer: torch.Tensor | None = None
) -> tuple[torch.Tensor, list[Any]]:
    """One 1-D tensor of the bucket's dtype holding every tensor back to back, and where each one lies.

    `buffer` (1-D, the bucket's dtype and device, large enough): the tensors are copied into its head, which is
    returned — one copy per tensor straight into its slot, strided views included (no intermediate `reshape`
    copies), and no new allocation per bucket. Without it a new tensor is made."""
    meta, start, cls = [], 0, _metadata_class()
    for name, t in bucket:
        meta.append(cls(name, t.shape, t.dtype, start, start + t.numel(), t.numel()))
        start += t.numel()
    if buffer is None:
        return torch.cat([t.detach().reshape(-1) for _, t in bucket]), meta
    flat = buffer[:start]
    slots = [flat[m.start_idx : m.end_idx].view(m.shape) for m in meta]
    torch._foreach_copy_(slots, [t.detach() for _, t in bucket])  # one grouped launch instead of one per tensor
    return flat, meta


def bucket_nbytes(bucket: list[tuple[str, torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for _, t in bucket)
