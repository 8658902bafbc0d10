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
import pickle
import time
from dataclasses import dataclass
from typing import Any

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


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _SGLANG_METADATA_CLASSES:
            return FlattenedTensorMetadata
        return super().find_class(module, name)


def deserialize(data: str | bytes) -> Any:
    raw = base64.b64decode(data) if isinstance(data, str) else data
    return _Unpickler(io.BytesIO(raw)).load()


def decode_payload(
    serialized: list[str | bytes], load_format: str | None, seconds: dict[str, float] | None = None
) -> list[tuple[str, torch.Tensor]]:
    """Receiver side: entry 0 of `serialized_named_tensors` -> list of (name, tensor).

    The tensors are views of the sender's memory (shared memory on CPU, a CUDA IPC mapping on GPU), valid until
    the request is answered: the engine copies them into its parameters, once, before it answers (as SGLang's
    loader does), so no intermediate copy is made here. `seconds` (optional) gets the unpickling's share
    (`unpickle`: it opens the IPC handle) apart from building the views."""
    if not serialized:
        raise ValueError("serialized_named_tensors is empty")
    t0 = time.perf_counter()
    obj = deserialize(serialized[0])
    if seconds is not None:
        seconds["unpickle"] = time.perf_counter() - t0
    if load_format == FLATTENED_BUCKET:
        views = _bucket_views(obj["flattened_tensor"], obj["metadata"])
        if seconds is not None:
            seconds["views"] = time.perf_counter() - t0 - seconds["unpickle"]
        return views
    if load_format not in (None, "direct"):
        raise ValueError(f"unsupported load_format {load_format!r} (expected null or 'flattened_bucket')")
    if isinstance(obj, dict):
        obj = list(obj.items())
    return [(str(n), t) for n, t in obj]


def _bucket_views(flat: torch.Tensor, metadata: list[Any]) -> list[tuple[str, torch.Tensor]]:
    """`flat[start_idx:end_idx].reshape(shape).to(dtype)` of every entry, the slices cut by one `split` call where
    the entries do not overlap (a sync sends hundreds: one Python-level slice each is most of the decoding time)
    — entries may come in any order with gaps between them (a trainer's buffer read in place)."""
    fields = [_fields(m) for m in metadata]
    order = sorted(range(len(fields)), key=lambda i: fields[i][1])
    sizes, slot, cursor, numel = [], [0] * len(fields), 0, flat.numel()
    for i in order:
        _, start, end, _, _ = fields[i]
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
        parts = flat.split(sizes) if fields else ()
    out = []
    for i, (name, start, end, shape, dtype) in enumerate(fields):
        t = (parts[slot[i]] if parts is not None else flat[start:end]).view(shape)
        out.append((name, t if t.dtype == dtype else t.to(dtype)))
    return out


def _fields(m: Any) -> tuple[str, int, int, tuple[int, ...], torch.dtype]:
    if isinstance(m, dict):
        return m["name"], m["start_idx"], m["end_idx"], tuple(m["shape"]), m["dtype"]
    return m.name, m.start_idx, m.end_idx, tuple(m.shape), m.dtype


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
