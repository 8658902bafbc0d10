"""Run real megatron-core 0.16.1 on a CPU-only torch, for tests and the laptop quick start.

Why a shim and not a fork: megatron-core hard-codes `device="cuda"`, `torch.cuda.current_device()` and the
CUDA RNG tracker in ~40 places (docs/megatron_contract.md#the-cpu-shim). Rather than patch those files, this module
(1) redirects CUDA device literals to the CPU through a process-wide `TorchFunctionMode`, (2) aliases the
CUDA RNG functions megatron calls to the CPU generator, so its RNG tracker (dropout forks, seeds) works,
and (3) replaces the gradient clipper, whose fp32 path asserts `torch.cuda.FloatTensor`.

It enters through slime's hook flag, never through an import from `slime/`:
``--custom-megatron-init-path sim.fake_megatron.cpu_shim.apply``. `apply(args)` is idempotent and a no-op
when CUDA is available, so the same flag is harmless on a GPU host. fp32 only: bf16 GEMMs fail on CPU.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

logger = logging.getLogger(__name__)

_APPLIED = False
_TYPE_LIE = False  # see enable_distributed_optimizer(); off unless a run asks for megatron's distributed optimizer
_LOCAL = threading.local()  # torch function modes are thread-local: enter the mode once per thread


def _is_cuda(device: Any) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):  # a bare int is a CUDA ordinal in torch's device arguments
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA placements to the CPU on every torch call made while the mode is active."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
            return args[0]
        if _TYPE_LIE and func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)  # "torch.FloatTensor" -> "torch.cuda.FloatTensor"
            return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


def _clip_grad_by_total_norm(
    parameters: Any, max_norm: float, total_norm: float, use_decoupled_grad: bool = False
) -> None:
    """CPU stand-in for `megatron.core.optimizer.clip_grads.clip_grad_by_total_norm_fp32`.

    Same contract: scale every grad by max_norm / (total_norm + 1e-6) when that is below 1. The norm itself
    is still computed (and all-reduced over the model-parallel group) by megatron's `get_grad_norm_fp32`.
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    coeff = max_norm / (total_norm + 1.0e-6)
    if coeff >= 1.0:
        return
    for p in params:
        grad = getattr(p, "decoupled_grad", None) if use_decoupled_grad else p.grad
        if grad is not None:
            grad.detach().mul_(coeff)


class _CpuEvent:
    """A recorded point on a `_CpuStream`: CPU work is synchronous, so it is always complete."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        return None

    def wait(self, stream: Any = None) -> None:
        return None

    def query(self) -> bool:
        return True


class _CpuStream:
    """Stands in for `torch.cuda.Stream` (MoE's all-to-all token dispatcher keeps a device-to-host side stream).

    On the CPU every op runs in program order, so waits and events are no-ops; streams compare by identity."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None

    def record_event(self, event: Any = None) -> _CpuEvent:
        return event if event is not None else _CpuEvent()

    def synchronize(self) -> None:
        return None


_DEFAULT_STREAM = _CpuStream()


class _StreamContext:
    def __init__(self, stream: Any = None) -> None:
        self.stream = stream

    def __enter__(self) -> Any:
        return self.stream

    def __exit__(self, *exc: Any) -> None:
        return None


def _patch_cuda_runtime() -> None:
    cuda = torch.cuda
    cuda.Stream = _CpuStream  # classes, not functions: transformers annotates with `torch.cuda.Stream | None`
    cuda.Event = _CpuEvent
    cuda.current_stream = lambda device=None: _DEFAULT_STREAM
    cuda.default_stream = lambda device=None: _DEFAULT_STREAM
    cuda.stream = _StreamContext
    cuda.current_device = lambda: "cpu"
    cuda.device_count = lambda: 0
    cuda.synchronize = lambda *a, **k: None
    cuda.empty_cache = lambda: None
    # The "CUDA" generator *is* the CPU generator: the tracker's per-name seeds then produce real,
    # distinct CPU states, and `model_parallel_cuda_manual_seed(seed)` seeds the CPU generator.
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    cuda.manual_seed_all = lambda seed: None  # torch.manual_seed calls it after seeding the CPU generator
    cuda.get_rng_state = cuda.random.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = cuda.random.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)


def _all_to_all_single_with_host_splits(original: Any) -> Any:
    """MoE's all-to-all dispatcher moves its split sizes to host numpy arrays only when they are on the GPU
    (`maybe_move_tensor_to_cpu`); on the CPU they stay tensors, which the c10d binding refuses. Patched on the
    module (not in the function mode): the backward all-to-all runs where the mode is not active."""

    def all_to_all_single(output: Any, input: Any, output_split_sizes: Any = None, input_split_sizes: Any = None,
                          *args: Any, **kwargs: Any) -> Any:  # fmt: skip
        if isinstance(output_split_sizes, torch.Tensor):
            output_split_sizes = output_split_sizes.tolist()
        if isinstance(input_split_sizes, torch.Tensor):
            input_split_sizes = input_split_sizes.tolist()
        return original(output, input, output_split_sizes, input_split_sizes, *args, **kwargs)

    all_to_all_single._slime_cpu_shim = True  # type: ignore[attr-defined]
    return all_to_all_single


def _patch_megatron() -> None:
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as mopt
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)
    clip_grads.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm
    if not getattr(torch.distributed.all_to_all_single, "_slime_cpu_shim", False):
        torch.distributed.all_to_all_single = _all_to_all_single_with_host_splits(torch.distributed.all_to_all_single)
    mopt.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm  # imported by name there
    # With the CPU generator standing in for CUDA's, every tracker fork "changes the CPU RNG state".
    logging.getLogger("megatron.core.tensor_parallel.random").setLevel(logging.ERROR)


def enable_distributed_optimizer() -> None:
    """Opt-in: let megatron's DistributedOptimizer accept CPU tensors (without it, its CUDA type check refuses them).

    It checks `param.type()` against the `torch.cuda.*Tensor` names, so while the shim's mode is active
    `Tensor.type()` without arguments reports the CUDA name of a CPU tensor. That is a lie every other caller
    would see too, hence opt-in: `apply(args)` turns it on only when `args.use_distributed_optimizer` is set
    (`--use-distributed-optimizer`), and tests that want it call this function explicitly.
    """
    global _TYPE_LIE
    if not _TYPE_LIE:
        _TYPE_LIE = True
        logger.info("CPU shim: Tensor.type() now reports torch.cuda.* names (distributed optimizer on CPU)")


def apply(args: Any = None) -> None:
    """slime's `--custom-megatron-init-path` hook: make megatron-core run on this CPU-only process.

    Call it from every thread that builds or runs the model (the device redirection is thread-local);
    repeated calls are cheap. `args.use_distributed_optimizer` also enables `enable_distributed_optimizer()`.
    """
    global _APPLIED
    if torch.cuda.is_available():
        return
    if not _APPLIED:
        _patch_cuda_runtime()
        _patch_megatron()
        _APPLIED = True
        # Ray pins OMP_NUM_THREADS=1 in actors; in the alternating loop the engines idle while the trainer runs,
        # so a single-host CPU run may give the trainer every core (opt-in: concurrent test runs would oversubscribe).
        if threads := int(os.environ.get("SLIME_CPU_THREADS", "0") or 0):
            torch.set_num_threads(threads)
        logger.info("megatron-core CPU shim applied (fp32 only, %d intra-op threads)", torch.get_num_threads())
    if args is not None and args.use_distributed_optimizer:
        enable_distributed_optimizer()
    if getattr(_LOCAL, "mode", None) is None:
        _LOCAL.mode = _CudaToCpuMode()
        _LOCAL.mode.__enter__()  # left entered for the life of the thread


def is_applied() -> bool:
    return _APPLIED
