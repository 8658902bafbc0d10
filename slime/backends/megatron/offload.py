"""Train-side offload for `--colocate` (and PPO's actor/critic time-sharing): a trainer sleeps while others use its GPU.

Protocol (one colocated rollout, in the order of `slime/scheduling/loop.py`; engine calls by the RolloutManager):

    engines: release_memory_occupation                       after generate (KV cache, weights, CUDA graphs)
    critic:  wake_up → values → train → sleep                PPO only
    actor:   wake_up → train → sleep(keep_weights)           `--offload-train`; params stay if a sync follows
    engines: resume_memory_occupation(["weights"])           before the weight sync
    actor:   update_weights (reads its live GPU weights) → sleep: the params go too (`release_weights`)
    engines: resume_memory_occupation(["kv_cache", "cuda_graph"])

Keeping the params through the sync costs no peak: the GPU then holds the trainer's params and the engine's
weights, far less than the trainer held while training. A sync without a train call before it (start-up,
critic-only PPO steps) reads the pinned host copy instead, moved back to the GPU tensor by tensor.

(docs/architecture.md#colocated-offload gives the reasons for this order.)

What a sleeping trainer keeps, per policy (the numbers are per parameter N of this rank, d the optimizer's DP
sharding, p the bytes of a param, 2 in bf16):

- **default (slime v0.3.0's)**: only what cannot be recomputed. The optimizer state (fp32 master params, Adam m
  and v: 12/d bytes) lives in a `torch_memory_saver` region without backup: it is copied to pinned host buffers
  (allocated at the first sleep and reused, copies on a side stream: PCIe speed, where the region's own backup
  ran at ~2 GB/s), then the region is paused;
  the fp32 grads (4) and the param buffers (p) are released without any copy — grads are zeroed before every
  step anyway, and the params come back from *one* pinned host copy of the weights (p), made once and refreshed
  at every sleep, which is also what weight sync reads while the trainer sleeps. Host while asleep: p + 12/d
  (both pinned buffers stay allocated while awake, so that no sleep pays for page-locking again).
- **`--legacy-offload`** (this project's first offloader): everything the trainer allocated (params, grads,
  optimizer) is one region backed up to the host on pause, and every sleep makes one more unpinned copy of the
  params for weight sync. Host while asleep: p + 4 + 12/d + p.

So the default saves p + 4 bytes (6 in bf16) per trained parameter on the host of every rank, for each trained
model (actor, and critic under PPO). Params and grads are released by resizing their storages to zero (their
views — DDP buckets, `main_grad`, the distributed optimizer's shards — stay valid) and re-grown on wake-up.

Backends: `torch_memory_saver` (CUDA, installed) pauses the regions; without it (the CPU simulation) the
default policy runs the same copies for real and releases the optimizer's storages by resizing — params, grads
and optimizer state are released and restored (the "host" buffers are then ordinary memory) — the calls are
recorded in order (`calls`) and every byte moved is booked in a `ByteLedger`, so the policy is tested on CPU by
what it does and by what it would hold. `events` keeps the coarse protocol (sleep / wake_up / update_weights)
that the driver reports.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

logger = logging.getLogger(__name__)

LEGACY_TAG = "train"  # --legacy-offload: everything the trainer allocates
OPTIMIZER_TAG = "optimizer"  # default: the optimizer state only
CATEGORIES = ("params", "grads", "optimizer", "weights_copy")


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


def _unique_storages(tensors: list[torch.Tensor]) -> list[tuple[torch.UntypedStorage, int]]:
    """(storage, bytes) of each distinct storage behind `tensors` (views of one DDP buffer share one)."""
    seen: dict[int, tuple[torch.UntypedStorage, int]] = {}
    for t in tensors:
        st = t.untyped_storage()
        if st.nbytes() and st.data_ptr() not in seen:
            seen[st.data_ptr()] = (st, st.nbytes())
    return list(seen.values())


@contextlib.contextmanager
def _copy_stream() -> Iterator[None]:
    """Host<->device copies on a side stream that first waits for the current one; synchronized on exit, so
    the copied bytes are complete (and the source may be released) when the block ends. No-op on CPU."""
    if not torch.cuda.is_available():
        yield
        return
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        yield
    stream.synchronize()


def host_rss_bytes() -> int:
    """This process's resident set (VmRSS; pinned host pages are resident and counted), 0 where unknown."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


@dataclass
class ByteLedger:
    """Bytes per category on the device and on the host, moved by each protocol step (`entries`, in order)."""

    device: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    host: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    entries: list[tuple[str, str, int, int]] = field(default_factory=list)  # (step, category, Δdevice, Δhost)

    def book(self, step: str, category: str, device: int = 0, host: int = 0) -> None:
        self.device[category] += device
        self.host[category] += host
        self.entries.append((step, category, device, host))

    def totals(self) -> dict[str, int]:
        return {"device": sum(self.device.values()), "host": sum(self.host.values())}


class TrainOffloader:
    """Sleep/wake of one training rank. `enabled` False (no --offload-train): every call is a no-op."""

    def __init__(self, enabled: bool, *, legacy: bool = False) -> None:
        self.enabled = enabled
        self.legacy = legacy
        self.saver = _memory_saver() if enabled else None
        self.asleep = False
        self.events: list[tuple[float, str]] = []
        self.calls: list[str] = []
        self.ledger = ByteLedger()
        self._model: torch.nn.Module | None = None
        self._params: list[tuple[torch.UntypedStorage, int]] = []
        self._grads: list[tuple[torch.UntypedStorage, int]] = []
        self._grad_tensors: list[torch.Tensor] = []
        self._optimizer: list[tuple[torch.UntypedStorage, int]] = []
        self._optimizer_host: list[torch.UntypedStorage] | None = None  # pinned, allocated at the first sleep
        self.host_weights: dict[str, torch.Tensor] | None = None  # what weight sync reads while asleep
        self._drowsy = False
        self.rss_asleep = 0

    @property
    def backend(self) -> str:
        return "torch_memory_saver" if self.saver is not None else "cpu"

    @property
    def policy(self) -> str:
        return "legacy" if self.legacy else "v0.3.0"

    def _record(self, name: str) -> None:
        self.events.append((time.time(), name))
        logger.info("train offload: %s (%s, %s policy)", name, self.backend, self.policy)

    @contextlib.contextmanager
    def region(self, kind: str) -> Iterator[None]:
        """Allocate a trainer part inside this: `model` (model + DDP buffers) or `optimizer` (its state).

        Legacy: both go into one `torch_memory_saver` region with its host backup. Default: only the optimizer
        does, without backup (we copy it to pinned buffers ourselves, faster): a region's pause returns every
        byte to the driver, where released storages of the caching allocator could stay stuck in segments
        shared with live blocks. Params and grads are released by storage resizing (contiguous DDP buffers)."""
        if kind not in ("model", "optimizer"):
            raise ValueError(f"unknown region kind {kind!r}")
        if self.saver is None or (not self.legacy and kind == "model"):
            yield
            return
        tag = LEGACY_TAG if self.legacy else OPTIMIZER_TAG
        with self.saver.region(tag=tag, enable_cpu_backup=self.legacy):
            yield

    def attach(self, model: torch.nn.Module, optimizer: Any) -> None:
        """Take stock of the trainer's buffers: param and grad storages, and the optimizer's own state."""
        self._model = model
        params = [p for _, p in model.named_parameters()]
        self._params = _unique_storages(params)
        self._grad_tensors = [p.main_grad for p in params if getattr(p, "main_grad", None) is not None]
        self._grads = _unique_storages(self._grad_tensors)
        model_ptrs = {st.data_ptr() for st, _ in self._params}
        opt_tensors: list[torch.Tensor] = []
        for opt in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
            inner = getattr(opt, "optimizer", opt)  # megatron's wrapper, or a plain torch optimizer
            for group in inner.param_groups:
                opt_tensors += [p for p in group["params"] if p.untyped_storage().data_ptr() not in model_ptrs]
            opt_tensors += [v for st in inner.state.values() for v in st.values() if torch.is_tensor(v) and v.dim()]
        self._optimizer = _unique_storages(opt_tensors)
        for cat, n in (("params", self.param_bytes), ("grads", self.grad_bytes), ("optimizer", self.optimizer_bytes)):
            self.ledger.book("attach", cat, device=n)

    @property
    def param_bytes(self) -> int:
        return sum(n for _, n in self._params)

    @property
    def grad_bytes(self) -> int:
        return sum(n for _, n in self._grads)

    @property
    def optimizer_bytes(self) -> int:
        return sum(n for _, n in self._optimizer)

    def _offload_optimizer(self) -> None:
        """Optimizer state → its pinned host buffers, then its device storages are released."""
        if self._optimizer_host is None:
            pin = torch.cuda.is_available()
            self._optimizer_host = [
                torch.empty(n, dtype=torch.uint8, device="cpu", pin_memory=pin).untyped_storage()
                for _, n in self._optimizer
            ]
        with _copy_stream():
            for (st, _), host in zip(self._optimizer, self._optimizer_host, strict=True):
                host.copy_(st, non_blocking=True)
        if self.saver is not None:
            self.saver.pause(OPTIMIZER_TAG)  # unmaps the region's physical memory (addresses stay valid)
            return
        for st, _ in self._optimizer:
            st.resize_(0)

    def _restore_optimizer(self) -> None:
        assert self._optimizer_host is not None
        if self.saver is not None:
            self.saver.resume(OPTIMIZER_TAG)  # fresh physical memory behind the same addresses: copied into next
        else:
            for st, n in self._optimizer:
                st.resize_(n)
        with _copy_stream():
            for (st, _), host in zip(self._optimizer, self._optimizer_host, strict=True):
                st.copy_(host, non_blocking=True)

    def _step(self, name: str) -> None:
        self.calls.append(name)

    @property
    def drowsy(self) -> bool:
        """Optimizer state and grads released, weights still live on the GPU (`sleep(keep_weights=True)`)."""
        return self._drowsy

    def sleep(self, keep_weights: bool = False) -> None:
        """Release what the trainer holds on the GPU. `keep_weights` (default policy): stop short of the params,
        so the weight sync that follows reads them on the GPU; a second `sleep()` then releases them too."""
        if not self.enabled or self.asleep:
            return
        if self._model is None:
            raise RuntimeError("TrainOffloader.sleep before attach(model, optimizer)")
        named = list(self._model.named_parameters())
        if self.legacy:  # one region: all or nothing
            self._step("copy_params_unpinned")
            self.host_weights = {n: p.detach().to("cpu", copy=True) for n, p in named}
            self.ledger.book("copy_params_unpinned", "weights_copy", host=self.param_bytes)
            self._step(f"pause:{LEGACY_TAG}")
            if self.saver is not None:
                torch.cuda.synchronize()
                self.saver.pause(LEGACY_TAG)
            for cat, n in (
                ("params", self.param_bytes),
                ("grads", self.grad_bytes),
                ("optimizer", self.optimizer_bytes),
            ):
                self.ledger.book(f"pause:{LEGACY_TAG}", cat, device=-n, host=n)  # fmt: skip
        else:
            was_drowsy = self._drowsy
            if not was_drowsy:
                self._step("release:grads")
                for st, _ in self._grads:
                    st.resize_(0)
                self.ledger.book("release:grads", "grads", device=-self.grad_bytes)
                self._step(f"pause:{OPTIMIZER_TAG}")
                self._offload_optimizer()
                self.ledger.book(f"pause:{OPTIMIZER_TAG}", "optimizer", device=-self.optimizer_bytes, host=self.optimizer_bytes)  # fmt: skip
            if keep_weights:
                self._drowsy = True
                self._empty_cache()
                self._record("sleep")
                return
            self._step("copy_params_to_pinned")
            self._copy_to_host_weights(named)
            self._step("release:params")
            for st, _ in self._params:
                st.resize_(0)
            self.ledger.book("release:params", "params", device=-self.param_bytes)
            self._drowsy = False
            if was_drowsy:  # the second half of a sleep already recorded
                self._empty_cache()
                self.asleep = True
                self.rss_asleep = host_rss_bytes()
                self._record("release_weights")
                return
        self._empty_cache()
        self.asleep = True
        self.rss_asleep = host_rss_bytes()
        self._record("sleep")

    @staticmethod
    def _empty_cache() -> None:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _copy_to_host_weights(self, named: list[tuple[str, torch.nn.Parameter]]) -> None:
        """Refresh the one pinned host copy of the weights (allocated at the first sleep, kept for good)."""
        if self.host_weights is None:
            pin = torch.cuda.is_available()
            self.host_weights = {
                n: torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=pin) for n, p in named
            }
            self.ledger.book("allocate_pinned_weights", "weights_copy", host=self.param_bytes)
        with torch.no_grad():
            for n, p in named:
                self.host_weights[n].copy_(p.detach(), non_blocking=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def wake_up(self) -> None:
        if not self.enabled or not (self.asleep or self._drowsy):
            return
        assert self._model is not None and (self.host_weights is not None or self._drowsy)
        named = list(self._model.named_parameters())
        if self.legacy:
            self._step(f"resume:{LEGACY_TAG}")
            if self.saver is not None:
                self.saver.resume(LEGACY_TAG)
            for cat, n in (
                ("params", self.param_bytes),
                ("grads", self.grad_bytes),
                ("optimizer", self.optimizer_bytes),
            ):
                self.ledger.book(f"resume:{LEGACY_TAG}", cat, device=n, host=-n)  # fmt: skip
            self._step("restore_params")
            if self.saver is not None:
                with torch.no_grad():
                    for n, p in named:
                        p.copy_(self.host_weights[n], non_blocking=True)
            self.host_weights = None
            self.ledger.book("restore_params", "weights_copy", host=-self.param_bytes)
        else:
            self._step(f"resume:{OPTIMIZER_TAG}")
            self._restore_optimizer()
            self.ledger.book(f"resume:{OPTIMIZER_TAG}", "optimizer", device=self.optimizer_bytes, host=-self.optimizer_bytes)  # fmt: skip
            if not self._drowsy:  # drowsy: the params never left
                self._step("restore_params")
                for st, n in self._params:
                    st.resize_(n)
                with torch.no_grad():
                    for n, p in named:
                        p.copy_(self.host_weights[n], non_blocking=True)
                self.ledger.book("restore_params", "params", device=self.param_bytes)
            self._drowsy = False
            self._step("zero_grads")
            for st, n in self._grads:
                st.resize_(n)
            with torch.no_grad():
                for g in self._grad_tensors:
                    g.zero_()
            self.ledger.book("zero_grads", "grads", device=self.grad_bytes)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.asleep = False
        self._record("wake_up")

    def named_params_for_export(self, model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
        """What weight sync reads: the host copy while asleep, else the live parameters."""
        if self.asleep and self.host_weights is not None:
            return list(self.host_weights.items())
        return list(model.named_parameters())

    def note(self, name: str) -> None:
        """Record a train-side step of the protocol (e.g. `train`, `update_weights`) in the event log."""
        if self.enabled:
            self._record(name)

    def memory_report(self) -> dict[str, Any]:
        """The ledger's state and the host RSS measured right after the last sleep (for metrics and benches).

        `pinned` is the part of the host bytes in page-locked memory (all of the default policy's; the legacy
        policy's but its extra copy of the weights, which is ordinary memory); 0 without a GPU."""
        host = dict(self.ledger.host)
        pinned = sum(host.values()) - (host["weights_copy"] if self.legacy else 0) if self.saver is not None else 0
        return {
            "policy": self.policy,
            "backend": self.backend,
            "asleep": self.asleep,
            "device": dict(self.ledger.device),
            "host": host,
            "pinned": pinned,
            "rss_asleep": self.rss_asleep,
        }


@contextlib.contextmanager
def no_region(kind: str) -> Iterator[None]:
    """What a trainer without an offloader allocates in: nothing special."""
    yield


class PhaseMemory:
    """Peak device bytes of each phase of a train call (CUDA only): `torch.cuda.max_memory_allocated` between
    phase ends, reported as `memory/<phase>_peak_bytes` (what `slime plan`'s memory plan predicts)."""

    def __init__(self) -> None:
        self.cuda = torch.cuda.is_available()
        self.peaks: dict[str, float] = {}
        self.free_at_start: float | None = None
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            # the whole device's free memory as the train call begins: colocated engines must have let theirs go
            self.free_at_start = float(torch.cuda.mem_get_info()[0])

    def end(self, phase: str) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            self.peaks[phase] = float(torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()

    def metrics(self) -> dict[str, float]:
        out = {f"memory/{k}_peak_bytes": v for k, v in self.peaks.items()}
        if self.free_at_start is not None:
            out["memory/device_free_at_train_bytes"] = self.free_at_start
        return out
