"""What a weight sync reads from a trainer rank, besides a plain export (`hf_weights.export_hf_weights`).

- **Live views** (`live_weights`): where no gather is needed (TP, EP and ETP of one) and the weights are on the
  GPU, views of the live parameters with their HF names, shapes and the engines' dtype. Built once and kept —
  the parameters' storages stay the same objects through sleep and wake-up, so the views stay valid — which
  takes the conversion code off the sync's path (a `LiveWeights`: the sync hands their storages over in place).
- **The host copy** (`export_from_host`): while the trainer sleeps (--offload-train) its device memory is paused,
  so the export reads the offloader's copy, moved back to the GPU one tensor at a time (pinned, ~PCIe speed) so
  that conversion, buckets and the engines' CUDA IPC hand-off stay on the device — a host-side bucket would
  travel through shared memory and be copied to the GPU again by each engine (seconds for a 1B model instead of
  tens of milliseconds).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from slime.backends.megatron.hf_config import HFModelSpec
from slime.backends.megatron.hf_weights import iter_hf_sources, iter_hf_tensors, layer_offset, unwrap_model
from slime.backends.megatron.weight_buckets import LiveWeights
from slime.parallel_state import ParallelState


def live_weights(
    chunks: list[Any], spec: HFModelSpec, ps: ParallelState, dtype: torch.dtype | None, hand_over: bool
) -> LiveWeights:
    """Views of every chunk's parameters as HF tensors; `hand_over`: the params are released after each sync."""
    return LiveWeights(
        (
            (name, src, shape, dtype or src.dtype)
            for chunk in chunks
            for name, src, shape in iter_hf_sources(
                unwrap_model(chunk).named_parameters(), spec, ps, layer_offset(chunk)
            )
        ),
        hand_over=hand_over,
    )


def export_from_host(
    offloader: Any, model: Any, spec: HFModelSpec, ps: ParallelState, dtype: torch.dtype | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """The sleeping trainer's HF-named full tensors, from the offloader's host copy of `model`'s parameters."""
    named: Iterable[tuple[str, torch.Tensor]] = offloader.named_params_for_export(unwrap_model(model))
    if torch.cuda.is_available():
        device = torch.cuda.current_device()
        named = ((n, t.to(device, non_blocking=True)) for n, t in named)
    for name, t in iter_hf_tensors(named, spec, ps, layer_offset(model)):
        yield name, t.to(dtype) if dtype is not None else t
