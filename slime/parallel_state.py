"""The `ParallelState` protocol: every loss, metric and schedule reduction is written against it.

Real runs implement it over megatron-core's `parallel_state` + `torch.distributed`; the simulator's fake
Megatron implements it with N simulated ranks in one process so property tests can run 64 ranks on a laptop.
Code that reduces takes a `ParallelState` argument, never a module-level global.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol, runtime_checkable

import torch

# `dp_cp` is Megatron's data-parallel-with-context-parallel group (gradients are averaged over it);
# `etp` is the expert tensor-parallel group.
Dim = Literal["tp", "pp", "dp", "cp", "ep", "etp", "dp_cp"]
DIMS: tuple[str, ...] = ("tp", "pp", "dp", "cp", "ep", "etp", "dp_cp")
ReduceOp = Literal["sum", "max", "min", "avg"]


@runtime_checkable
class ParallelState(Protocol):
    """Sizes, ranks, groups and the collectives the framework uses, per parallel dimension."""

    @property
    def global_rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def size(self, dim: Dim) -> int: ...

    def rank(self, dim: Dim) -> int: ...

    def group(self, dim: Dim) -> Any:
        """An opaque handle to this rank's group along `dim` (a ProcessGroup on real runs)."""
        ...

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = "sum", dim: Dim = "dp") -> torch.Tensor:
        """Reduce in place across `dim` and return the tensor."""
        ...

    def all_gather(self, tensor: torch.Tensor, dim: Dim = "dp") -> list[torch.Tensor]:
        """One tensor per rank of `dim`, in group-rank order."""
        ...

    def broadcast(self, tensor: torch.Tensor, src: int = 0, dim: Dim = "dp") -> torch.Tensor:
        """Copy group-rank `src`'s tensor into `tensor` on every rank of `dim` (in place) and return it."""
        ...

    def reduce_scatter(self, tensor: torch.Tensor, op: ReduceOp = "sum", dim: Dim = "dp") -> torch.Tensor:
        """Reduce across `dim`, then return this rank's equal chunk (along dim 0) of the result."""
        ...

    def barrier(self, dim: Dim = "dp") -> None: ...
