"""Colocated weight sync through `/update_weights_from_tensor` (spec §1.5), as SGLang 0.5.23 receives it.

Order on every engine of the updatable model: pause → flush → begin_weight_update → load bucket by bucket →
end_weight_update → flush → continue (SGLang 0.5.23 refuses loads outside a begin/end weight-update session:
managers/scheduler_components/weight_updater.py). Tensors are
flattened into one 1-D bucket per dtype of at most `--update-weight-buffer-size` bytes and pickled with
torch's multiprocessing reductions: on CPU the storage moves to named shared memory (`file_system`
strategy) and only the name travels; on GPU the same pickling yields CUDA IPC handles. The sender keeps each
bucket alive until every engine has answered, because the receiver copies out of the shared storage.
"""

from __future__ import annotations

import base64
import io
import logging
import pickle
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

import httpx
import torch
import torch.multiprocessing as mp
import torch.multiprocessing.reductions  # noqa: F401 - registers tensor reductions with ForkingPickler

logger = logging.getLogger(__name__)


@dataclass
class FlattenedTensorMetadata:
    """Field-for-field SGLang's `FlattenedTensorMetadata` (python/sglang/srt/weight_sync/tensor_bucket.py)."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


def serialize(obj: Any) -> str:
    """What SGLang's `MultiprocessingSerializer.serialize(obj, output_str=True)` produces."""
    mp.set_sharing_strategy("file_system")
    buf = io.BytesIO()
    ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(obj)
    return base64.b64encode(buf.getvalue()).decode()


def flattened_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[dict[str, Any]]:
    """Group tensors by dtype into flat buckets of at most `bucket_bytes` (a larger tensor gets its own)."""
    pending: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
    sizes: dict[torch.dtype, int] = {}

    def flush(dtype: torch.dtype) -> dict[str, Any]:
        items = pending.pop(dtype)
        sizes.pop(dtype)
        flat = torch.cat([t.detach().reshape(-1) for _, t in items])
        meta, start = [], 0
        for name, t in items:
            meta.append(FlattenedTensorMetadata(name, t.shape, t.dtype, start, start + t.numel(), t.numel()))
            start += t.numel()
        return {"flattened_tensor": flat, "metadata": meta}

    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if tensor.dtype in pending and sizes[tensor.dtype] + nbytes > bucket_bytes:
            yield flush(tensor.dtype)
        pending.setdefault(tensor.dtype, []).append((name, tensor))
        sizes[tensor.dtype] = sizes.get(tensor.dtype, 0) + nbytes
    for dtype in list(pending):
        yield flush(dtype)


class TensorWeightSync:
    """Pushes full HF-named weights to every engine URL; one instance per sending train rank."""

    def __init__(self, bucket_bytes: int = 512 * 1024**2, timeout: float = 600.0) -> None:
        self.bucket_bytes = bucket_bytes
        self.client = httpx.Client(timeout=timeout)

    def _post(self, url: str, endpoint: str, body: dict[str, Any] | None = None) -> Any:
        r = self.client.post(f"{url}{endpoint}", json=body or {})
        if r.status_code != 200:
            raise RuntimeError(f"{url}{endpoint} answered {r.status_code}: {r.text[:300]}")
        try:
            return r.json() if r.content else None
        except ValueError:  # several SGLang control endpoints answer plain text
            return r.text

    def sync(
        self, engine_urls: list[str], named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: int
    ) -> dict[str, float]:
        """pause → flush → begin → load → end → flush → continue on every engine; returns bytes/buckets sent."""
        for url in engine_urls:
            self._post(url, "/pause_generation")
        for url in engine_urls:
            self._post(url, "/flush_cache")
            self._post(url, "/begin_weight_update", {"selector": "all"})
        num_bytes = num_buckets = 0
        for bucket in flattened_buckets(named_tensors, self.bucket_bytes):
            payload = serialize(bucket)
            body = {
                "serialized_named_tensors": [payload],
                "load_format": "flattened_bucket",
                "flush_cache": False,
                "weight_version": str(weight_version),
            }
            for url in engine_urls:
                out = self._post(url, "/update_weights_from_tensor", body)
                if isinstance(out, dict) and out.get("success") is False:
                    raise RuntimeError(f"{url} rejected the weight update: {out.get('message')}")
            num_bytes += bucket["flattened_tensor"].numel() * bucket["flattened_tensor"].element_size()
            num_buckets += 1
            del bucket, payload  # shared storage may be released only after every engine copied it
        for url in engine_urls:
            self._post(url, "/end_weight_update")
            self._post(url, "/flush_cache")
            self._post(url, "/continue_generation")
        logger.info("weight version %d: %d buckets, %.1f MiB to %d engines", weight_version, num_buckets,
                    num_bytes / 2**20, len(engine_urls))  # fmt: skip
        return {"weight_sync/bytes": float(num_bytes), "weight_sync/buckets": float(num_buckets)}
