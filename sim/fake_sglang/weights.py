"""Wire format of `/update_weights_from_tensor` on CPU, both sides (slime writes its own sender against this).

Body (python/sglang/srt/managers/io_struct.py: UpdateWeightsFromTensorReqInput)::

    {
      "serialized_named_tensors": [S_rank0, S_rank1, ...],   # one entry per TP rank of the engine
      "load_format": null | "flattened_bucket",
      "flush_cache": true,
      "abort_all_requests": false,
      "weight_version": "3"                                  # optional; becomes meta_info.weight_version
    }

Each ``S`` is ``base64.b64encode(ForkingPickler.dumps(payload)).decode()`` — what SGLang's
`MultiprocessingSerializer.serialize(obj, output_str=True)` produces (python/sglang/srt/utils/common.py).
The sender first calls ``torch.multiprocessing.set_sharing_strategy("file_system")``, so pickling a CPU tensor
moves its storage to named shared memory and only the name travels; the sender MUST keep the tensors
referenced until the HTTP call returns (the receiver copies them into the model before answering).
On GPU the same pickling yields CUDA IPC handles.

``payload`` is, for ``load_format`` null, a list of ``(name, tensor)`` tuples in HF parameter names; for
``"flattened_bucket"`` a dict ``{"flattened_tensor": 1-D tensor, "metadata": [m, ...]}`` where each ``m``
mirrors SGLang's `FlattenedTensorMetadata` (python/sglang/srt/weight_sync/tensor_bucket.py): ``name``,
``shape``, ``dtype``, ``start_idx``, ``end_idx``, ``numel`` — as attributes or as dict keys. Tensor ``i`` is
``flattened_tensor[start_idx:end_idx].reshape(shape).to(dtype)``. The receiver here unpickles SGLang's own
metadata class without SGLang installed (it is mapped to a local stand-in).

The fake serves TP size 1, so it reads entry 0 (SGLang's rank r reads entry r).
"""

from __future__ import annotations

import base64
import io
import math
import pickle
import time
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.multiprocessing.reductions  # noqa: F401 - registers tensor reductions (the unpickler needs them)

FLATTENED_BUCKET = "flattened_bucket"


@dataclass
class FlattenedTensorMetadata:
    """Field-for-field stand-in for sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata."""

    name: str
    shape: Any
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


_SGLANG_METADATA_CLASSES = {
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"),
    ("sglang.srt.model_executor.model_runner", "FlattenedTensorMetadata"),
}


# python/sglang/srt/utils/common.py SafeUnpickler: the modules a payload may name (0.5.14-0.5.20 check these
# prefixes; 0.5.21+ list single classes from the same modules). Anything else is refused before it is imported.
_ALLOWED_MODULES = (
    "builtins.", "collections.", "copyreg.", "functools.", "itertools.", "operator.", "types.", "weakref.",
    "torch.", "multiprocessing.resource_sharer.", "multiprocessing.reduction.", "sglang.srt.",
)  # fmt: skip


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _SGLANG_METADATA_CLASSES:
            return FlattenedTensorMetadata
        if not (module + ".").startswith(_ALLOWED_MODULES):
            raise RuntimeError(
                f"Blocked unsafe class loading ({module}.{name}), to prevent exploitation of CVE-2025-10164"
            )
        return super().find_class(module, name)


def deserialize(data: str | bytes) -> Any:
    raw = base64.b64decode(data) if isinstance(data, str) else data
    return _Unpickler(io.BytesIO(raw)).load()


class Received(NamedTuple):
    """One post's tensors as the engine takes them: the names, the shapes they stand for, and the tensors — for a
    flattened bucket 1-D slices of the sender's flat tensor (in the metadata's dtype), which the engine copies into
    flat views of its parameters; otherwise the tensors as sent. Why slices and not views in shape: a sync sends
    hundreds of tensors per post, and a `view(shape)` each (~2-3 us) was most of the decoding
    (`bench/gpu_ipc_parts.py`)."""

    names: list[str]
    shapes: list[tuple[int, ...]]
    tensors: list[torch.Tensor]

    def named(self) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor in its shape) pairs."""
        return [(n, t.view(s)) for n, s, t in zip(self.names, self.shapes, self.tensors, strict=True)]


def decode(
    serialized: list[str | bytes], load_format: str | None, seconds: dict[str, float] | None = None
) -> Received:
    """Receiver side: entry 0 of `serialized_named_tensors` -> `Received`.

    The tensors are views of the sender's memory (shared memory on CPU, a CUDA IPC mapping on GPU), valid until
    the request is answered: the engine copies them into its parameters, once, before it answers (as SGLang's
    loader does), so no intermediate copy is made here. `seconds` (optional) gets the unpickling's share
    (`unpickle`: it opens the IPC handle) apart from cutting the tensors out (`views`)."""
    if not serialized:
        raise ValueError("serialized_named_tensors is empty")
    t0 = time.perf_counter()
    obj = deserialize(serialized[0])
    t1 = time.perf_counter()
    if load_format == FLATTENED_BUCKET:
        received = _bucket_slices(obj["flattened_tensor"], obj["metadata"])
    elif load_format in (None, "direct"):
        pairs = list(obj.items()) if isinstance(obj, dict) else list(obj)
        received = Received([str(n) for n, _ in pairs], [tuple(t.shape) for _, t in pairs], [t for _, t in pairs])
    else:
        raise ValueError(f"unsupported load_format {load_format!r} (expected null or 'flattened_bucket')")
    if seconds is not None:
        seconds["unpickle"], seconds["views"] = t1 - t0, time.perf_counter() - t1
    return received


def decode_payload(
    serialized: list[str | bytes], load_format: str | None, seconds: dict[str, float] | None = None
) -> list[tuple[str, torch.Tensor]]:
    """`decode` as (name, tensor in its shape) pairs."""
    return decode(serialized, load_format, seconds).named()


def _bucket_slices(flat: torch.Tensor, metadata: list[Any]) -> Received:
    """`flat[start_idx:end_idx]` (`.to(dtype)` where the metadata says another dtype) of every entry, cut by one
    `split` call where the entries do not overlap — entries may come in any order with gaps between them (a
    trainer's buffer read in place). Each field is read by one pass over the entries (a function call per entry
    costs as much as the rest)."""
    if metadata and isinstance(metadata[0], dict):
        names, starts, ends, shapes, dtypes = (
            [m[k] for m in metadata] for k in ("name", "start_idx", "end_idx", "shape", "dtype")
        )
    else:
        names, shapes, dtypes = [m.name for m in metadata], [m.shape for m in metadata], [m.dtype for m in metadata]
        starts, ends = [m.start_idx for m in metadata], [m.end_idx for m in metadata]
    shapes = [tuple(s) for s in shapes]
    order = range(len(names))
    if any(starts[i] > starts[i + 1] for i in range(len(starts) - 1)):
        order = sorted(order, key=starts.__getitem__)
    sizes, slot, cursor, numel = [], [0] * len(names), 0, flat.numel()
    for i in order:
        start, end = starts[i], ends[i]
        if start < cursor or end < start or end > numel:
            parts = None  # overlapping or out of range: slice one by one (slicing reports a bad range itself)
            break
        if start > cursor:
            sizes.append(start - cursor)  # a gap
        slot[i] = len(sizes)
        sizes.append(end - start)
        cursor = end
    else:
        if cursor < numel:
            sizes.append(numel - cursor)
        parts = flat.split(sizes) if names else ()
    if parts is not None:
        tensors = [parts[k] for k in slot]
    else:
        tensors = [flat[a:b] for a, b in zip(starts, ends, strict=True)]
    for i, (shape, n) in enumerate(zip(shapes, (t.numel() for t in tensors), strict=True)):
        if n != math.prod(shape):
            raise ValueError(f"{names[i]}: {n} elements between start_idx and end_idx for shape {list(shape)}")
    if any(d != flat.dtype for d in dtypes):
        tensors = [t if d == flat.dtype else t.to(d) for t, d in zip(tensors, dtypes, strict=True)]
    return Received([str(n) for n in names], shapes, tensors)


def build_update_body(
    named_tensors: list[tuple[str, torch.Tensor]],
    *,
    load_format: str | None = None,
    weight_version: str | None = None,
    flush_cache: bool = True,
    tp_size: int = 1,
) -> tuple[dict[str, Any], Any]:
    """A sender for tests (slime's own bucket layout and serializer): (JSON body for `/update_weights_from_tensor`,
    keepalive object).

    Keep the returned keepalive (and `named_tensors`) referenced until the request returns: their storages
    are now the shared memory the server maps.
    """
    from slime.backends.megatron.weight_buckets import flatten
    from slime.backends.megatron.weight_sync import serialize

    if not named_tensors:
        raise ValueError("cannot build an empty bucket")
    if load_format == FLATTENED_BUCKET:
        flat, meta = flatten(named_tensors)
        payload: Any = {"flattened_tensor": flat, "metadata": meta}
    else:
        payload = list(named_tensors)
    s = serialize(payload)
    body = {
        "serialized_named_tensors": [s] * tp_size,
        "load_format": load_format,
        "flush_cache": flush_cache,
        "weight_version": weight_version,
    }
    return body, payload
