"""Train-side offload for `--colocate`: the trainer sleeps while the engines on its GPUs roll out.

Protocol (one colocated rollout, driven by `slime/train.py`; engine calls by the RolloutManager):

    engines: release_memory_occupation                       after generate (KV cache, weights, CUDA graphs)
    trainer: wake_up → train → sleep                         `--offload-train`
    engines: resume_memory_occupation(["weights"])           before the weight sync
    trainer: update_weights (asleep: reads the host copy)
    engines: resume_memory_occupation(["kv_cache", "cuda_graph"])

(docs/architecture.md#colocated-offload gives the reasons for this order.)

Why sleep/wake are hooks here and not inside megatron: what is freed depends on the allocator. With
`torch_memory_saver` (GPU, installed) the model, grads and optimizer state are allocated inside a pausable
region (`memory_region()` around the trainer's construction); `sleep()` keeps a host copy of the parameters
(the weight-sync source while asleep, and what restores them) and pauses the region, `wake_up()` resumes it
and copies the parameters back. Without it (the CPU simulation) memory is not moved at all, but the calls
still happen in the real order and are recorded in `events` (time, name), which the driver exposes so tests
can check the order against the engines' request logs.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

import torch

logger = logging.getLogger(__name__)

TMS_TAG = "train"


def _memory_saver() -> Any | None:
    """torch_memory_saver's singleton when it can work here (installed and CUDA present), else None."""
    if not torch.cuda.is_available():
        return None
    try:
        from torch_memory_saver import torch_memory_saver
    except ImportError:
        return None
    torch_memory_saver.hook_mode = "torch"  # torch's pluggable-allocator hook: no LD_PRELOAD needed
    return torch_memory_saver


class TrainOffloader:
    """Sleep/wake of one training rank. `enabled` False (no --offload-train): every call is a no-op."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.saver = _memory_saver() if enabled else None
        self.asleep = False
        self.param_backup: dict[str, torch.Tensor] | None = None
        self.events: list[tuple[float, str]] = []

    @property
    def backend(self) -> str:
        return "torch_memory_saver" if self.saver is not None else "noop"

    def _record(self, name: str) -> None:
        self.events.append((time.time(), name))
        logger.info("train offload: %s (%s)", name, self.backend)

    @contextlib.contextmanager
    def memory_region(self) -> Iterator[None]:
        """Allocate inside this to make it pausable (model, DDP buffers, optimizer); a no-op without a saver."""
        if self.saver is None:
            yield
            return
        with self.saver.region(tag=TMS_TAG, enable_cpu_backup=True):
            yield

    def sleep(self, model: torch.nn.Module) -> None:
        if not self.enabled or self.asleep:
            return
        if self.saver is not None:
            # Host copy first: weight sync reads it while the device memory is gone.
            self.param_backup = {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters()}
            torch.cuda.synchronize()
            self.saver.pause(TMS_TAG)
            torch.cuda.empty_cache()
        self.asleep = True
        self._record("sleep")

    def wake_up(self, model: torch.nn.Module) -> None:
        if not self.enabled or not self.asleep:
            return
        if self.saver is not None:
            self.saver.resume(TMS_TAG)
            if self.param_backup is not None:
                with torch.no_grad():
                    for n, p in model.named_parameters():
                        p.copy_(self.param_backup[n], non_blocking=True)
                torch.cuda.synchronize()
            self.param_backup = None
        self.asleep = False
        self._record("wake_up")

    def named_params_for_export(self, model: torch.nn.Module) -> Any:
        """What weight sync reads: the host copy while asleep on a GPU, else the live parameters."""
        if self.asleep and self.param_backup is not None:
            return list(self.param_backup.items())
        return list(model.named_parameters())

    def note(self, name: str) -> None:
        """Record a train-side step of the protocol (e.g. `train`, `update_weights`) in the event log."""
        if self.enabled:
            self._record(name)
