"""`ParallelState` over megatron-core's `parallel_state` groups and `torch.distributed` (the real-run twin of
the simulator's ranks).

Why a wrapper: slime's loss/metric reducers and schedules are written against the `ParallelState` protocol so
that property tests can run them on 64 simulated ranks; on a real run the same code must hit megatron's
process groups. Semantics follow the protocol and the simulator: `src` of `broadcast` is a *group* rank;
`avg` is sum / group size (gloo has no AVG); sum/avg `all_reduce` of a tensor that requires grad is
differentiable (backward all-reduces the gradient) and returns a new tensor, otherwise it works in place.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from slime.parallel_state import DIMS, Dim, ReduceOp

logger = logging.getLogger(__name__)

_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def _megatron_groups() -> dict[str, Any]:
    from megatron.core import parallel_state as mpu

    return {
        "tp": mpu.get_tensor_model_parallel_group(),
        "pp": mpu.get_pipeline_model_parallel_group(),
        "dp": mpu.get_data_parallel_group(with_context_parallel=False),
        "cp": mpu.get_context_parallel_group(),
        "ep": mpu.get_expert_model_parallel_group(),
        "etp": mpu.get_expert_tensor_parallel_group(),
        "dp_cp": mpu.get_data_parallel_group(with_context_parallel=True),
    }


class _DiffAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, ps: MegatronParallelState, op: str, dim: str) -> torch.Tensor:
        ctx.ps, ctx.op, ctx.dim = ps, op, dim
        return ps._all_reduce_inplace(tensor.detach().clone(), op, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return ctx.ps._all_reduce_inplace(grad.detach().clone(), ctx.op, ctx.dim), None, None, None


class MegatronParallelState:
    """This rank's view of the megatron process groups; build it after `initialize_model_parallel`."""

    def __init__(self, groups: dict[str, Any] | None = None) -> None:
        self._groups = groups if groups is not None else _megatron_groups()
        missing = [d for d in DIMS if d not in self._groups]
        if missing:
            raise ValueError(f"missing process groups for dims {missing}")
        self._sizes = {d: dist.get_world_size(g) for d, g in self._groups.items()}
        self._ranks = {d: dist.get_rank(g) for d, g in self._groups.items()}

    @property
    def global_rank(self) -> int:
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        return dist.get_world_size()

    def size(self, dim: Dim) -> int:
        return self._sizes[dim]

    def rank(self, dim: Dim) -> int:
        return self._ranks[dim]

    def group(self, dim: Dim) -> Any:
        return self._groups[dim]

    def _all_reduce_inplace(self, tensor: torch.Tensor, op: str, dim: str) -> torch.Tensor:
        if self._sizes[dim] > 1:
            if tensor.device.type == "cpu" and dist.get_backend(self._groups[dim]) == "nccl":
                # NCCL reduces device memory only; small host-side statistics make the round trip.
                staged = tensor.cuda()
                dist.all_reduce(staged, op=_OPS[op], group=self._groups[dim])
                tensor.copy_(staged)
            else:
                dist.all_reduce(tensor, op=_OPS[op], group=self._groups[dim])
        if op == "avg":
            tensor.div_(self._sizes[dim])
        return tensor

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = "sum", dim: Dim = "dp") -> torch.Tensor:
        if op not in _OPS:
            raise ValueError(f"unknown reduce op {op!r} (sum, avg, max, min)")
        if tensor.requires_grad and torch.is_grad_enabled():
            if op in ("sum", "avg"):
                return _DiffAllReduce.apply(tensor, self, op, dim)
            return self._all_reduce_inplace(tensor.detach().clone(), op, dim)
        return self._all_reduce_inplace(tensor, op, dim)

    def all_gather(self, tensor: torch.Tensor, dim: Dim = "dp") -> list[torch.Tensor]:
        n = self._sizes[dim]
        if n == 1:
            return [tensor.detach().clone()]
        src = tensor.detach().contiguous()
        host = src.device.type == "cpu" and dist.get_backend(self._groups[dim]) == "nccl"
        if host:
            src = src.cuda()
        out = [torch.empty_like(src) for _ in range(n)]
        dist.all_gather(out, src, group=self._groups[dim])
        return [t.cpu() for t in out] if host else out

    def broadcast(self, tensor: torch.Tensor, src: int = 0, dim: Dim = "dp") -> torch.Tensor:
        n = self._sizes[dim]
        if not 0 <= src < n:
            raise ValueError(f"broadcast src {src} is not a group rank of dim {dim!r} (size {n})")
        if n > 1:
            group = self._groups[dim]
            with torch.no_grad():
                dist.broadcast(tensor, src=dist.get_global_rank(group, src), group=group)
        return tensor

    def reduce_scatter(self, tensor: torch.Tensor, op: ReduceOp = "sum", dim: Dim = "dp") -> torch.Tensor:
        n = self._sizes[dim]
        if tensor.dim() == 0 or tensor.shape[0] % n:
            raise ValueError(
                f"reduce_scatter needs dim 0 divisible by the {dim!r} size {n}, got {tuple(tensor.shape)}"
            )
        chunk = tensor.shape[0] // n
        # gloo has no reduce_scatter: all-reduce a copy and keep our chunk (cheap at the sizes slime reduces).
        full = self._all_reduce_inplace(tensor.detach().clone(), op, dim)
        return full.narrow(0, self._ranks[dim] * chunk, chunk).clone()

    def barrier(self, dim: Dim = "dp") -> None:
        if self._sizes[dim] > 1:
            dist.barrier(group=self._groups[dim])

    def __repr__(self) -> str:
        dims = " ".join(f"{d}={self._ranks[d]}/{self._sizes[d]}" for d in DIMS)
        return f"MegatronParallelState(rank={self.global_rank} {dims})"
