"""N simulated Megatron ranks in one process: one thread per rank, collectives over torch tensors.

Why threads: code under test is written against `ParallelState` exactly as it runs on real ranks
(straight-line code with blocking collectives), so each rank needs its own stack. Determinism comes from
the collectives, not the scheduler: every reduction is computed once, in group-rank order, by the last
rank to arrive, and every rank copies that one result — so results are bit-identical across ranks and
equal to a sequential reference, whatever order the threads run in.

Failure handling: an exception on any rank aborts the run; ranks blocked in a collective wake up with
`SimulationAborted` and `run` re-raises the original exception (with a note naming its rank). A rank
that returns while group peers wait for it, or a collective that waits longer than `timeout_s`, is
reported instead of hanging.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from slime.backends.megatron.rank_layout import expert_rank_groups, rank_groups, rank_of

logger = logging.getLogger(__name__)

T = TypeVar("T")

# ParallelState's dims plus extras that are handy in tests: mp (= tp-pp, Megatron's model-parallel
# group), edp (expert data parallel: where expert gradients are averaged), tp_dp_cp.
SIM_DIMS: tuple[str, ...] = ("tp", "pp", "dp", "cp", "ep", "etp", "dp_cp", "mp", "edp", "tp_dp_cp")
_OPS = ("sum", "max", "min", "avg")


class SimulationAborted(RuntimeError):
    """Raised on ranks blocked in a collective after another rank failed."""


class CollectiveError(RuntimeError):
    """Ranks of one group disagreed about a collective (kind, op, shape, dtype), or one never came."""


class CollectiveTimeout(CollectiveError):
    """A collective waited longer than the world's timeout (usually: ranks issued collectives in different orders)."""


class _Slot:
    """One collective call on one group: contributions by group position, and the shared outcome."""

    __slots__ = ("items", "arrived", "done", "result", "error", "read")

    def __init__(self, n: int) -> None:
        self.items: list[tuple[tuple, Any] | None] = [None] * n
        self.arrived = 0
        self.done = False
        self.result: Any = None
        self.error: tuple[type[Exception], str] | None = None
        self.read = 0


class _Channel:
    """A communicator for one group of one dim: calls are matched by per-rank sequence number."""

    def __init__(self, dim: str, ranks: list[int]) -> None:
        self.dim = dim
        self.ranks = ranks
        self.cond = threading.Condition()
        self.slots: dict[int, _Slot] = {}


class _RunState:
    """Channels and failure flags of one `SimulatedWorld.run` call."""

    def __init__(self, world: SimulatedWorld) -> None:
        self.channels = {
            (dim, gi): _Channel(dim, group) for dim in SIM_DIMS for gi, group in enumerate(world.groups(dim))
        }
        self.aborted = False
        self.finished: set[int] = set()
        self.timeout_s = world.timeout_s

    def _wake_all(self) -> None:
        for ch in self.channels.values():
            with ch.cond:
                ch.cond.notify_all()

    def abort(self) -> None:
        self.aborted = True
        self._wake_all()

    def mark_finished(self, rank: int) -> None:
        self.finished.add(rank)
        self._wake_all()


def _reduce(items: list[torch.Tensor], op: str) -> torch.Tensor:
    """Reduce in group-rank order, so every caller (and a sequential reference) gets the same bits."""
    if op == "avg" and not (items[0].is_floating_point() or items[0].is_complex()):
        raise TypeError(f"op='avg' needs a floating tensor, got {items[0].dtype}")
    acc = items[0].clone()
    for x in items[1:]:
        if op in ("sum", "avg"):
            acc.add_(x)
        elif op == "max":
            acc = torch.maximum(acc, x)
        else:
            acc = torch.minimum(acc, x)
    if op == "avg":
        acc.div_(len(items))
    return acc


class _AllReduce(torch.autograd.Function):
    """Differentiable sum/avg all-reduce: the backward is the same all-reduce of the gradients.

    Like `torch.distributed.nn.functional.all_reduce`, every rank of the group must run backward.
    """

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, view: SimRank, op: str, dim: str) -> torch.Tensor:
        ctx.view, ctx.op, ctx.dim = view, op, dim
        out = tensor.detach().clone()
        view._all_reduce_inplace(out, op, dim)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        g = grad.detach().clone()
        ctx.view._all_reduce_inplace(g, ctx.op, ctx.dim)
        return g, None, None, None


class SimRank:
    """One simulated rank: implements `slime.parallel_state.ParallelState`.

    Collectives are not differentiable except `all_reduce` with op sum/avg on a tensor that requires
    grad: that returns a *new* tensor (autograd forbids in-place writes into leaves) whose gradient is
    all-reduced in backward. max/min on such a tensor return a detached result. Always use the return
    value.
    """

    def __init__(self, world: SimulatedWorld, state: _RunState, rank: int) -> None:
        self._world = world
        self._state = state
        self._rank = rank
        self._seq: dict[tuple[str, int], int] = {}

    # ---- topology
    @property
    def global_rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world.world_size

    def size(self, dim: str) -> int:
        return self._world.size(dim)

    def rank(self, dim: str) -> int:
        return self._world._where(dim)[self._rank][1]

    def group(self, dim: str) -> tuple[int, ...]:
        """The global ranks of this rank's group along `dim`, in group-rank order."""
        gi = self._world._where(dim)[self._rank][0]
        return tuple(self._world.groups(dim)[gi])

    # ---- collectives
    def _exchange(self, dim: str, signature: tuple, payload: Any, combine: Callable[[list[Any]], Any]) -> Any:
        gi, pos = self._world._where(dim)[self._rank]
        channel = self._state.channels[(dim, gi)]
        seq = self._seq.get((dim, gi), 0)
        self._seq[(dim, gi)] = seq + 1
        n = len(channel.ranks)
        with channel.cond:
            slot = channel.slots.setdefault(seq, _Slot(n))
            slot.items[pos] = (signature, payload)
            slot.arrived += 1
            if slot.arrived == n:
                self._complete(slot, channel, seq, combine)
                channel.cond.notify_all()
            else:
                self._wait(slot, channel, seq, signature)
            slot.read += 1
            if slot.read == n:
                del channel.slots[seq]
        if slot.error is not None:
            raise _rebuild(*slot.error)
        return slot.result

    @staticmethod
    def _complete(slot: _Slot, channel: _Channel, seq: int, combine: Callable[[list[Any]], Any]) -> None:
        signatures = [item[0] for item in slot.items]  # type: ignore[index]
        if any(s != signatures[0] for s in signatures):
            calls = ", ".join(f"rank {r}: {s}" for r, s in zip(channel.ranks, signatures, strict=True))
            slot.error = (CollectiveError, f"mismatched collective #{seq} on dim {channel.dim!r}: {calls}")
        else:
            try:
                slot.result = combine([item[1] for item in slot.items])  # type: ignore[index]
            except Exception as e:  # delivered to every rank of the group
                slot.error = (type(e), f"{e} (collective #{seq} on dim {channel.dim!r}, group {channel.ranks})")
        slot.done = True

    def _wait(self, slot: _Slot, channel: _Channel, seq: int, signature: tuple) -> None:
        deadline = time.monotonic() + self._state.timeout_s
        while not slot.done:
            if self._state.aborted:
                raise SimulationAborted(f"rank {self._rank}: run aborted while in {signature[0]} on {channel.dim!r}")
            gone = [
                r
                for r, item in zip(channel.ranks, slot.items, strict=True)
                if item is None and r in self._state.finished
            ]
            if gone:
                raise CollectiveError(
                    f"rank {self._rank} waits in {signature[0]} #{seq} on dim {channel.dim!r} (group "
                    f"{channel.ranks}) but ranks {gone} already returned without calling it"
                )
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = [r for r, item in zip(channel.ranks, slot.items, strict=True) if item is None]
                raise CollectiveTimeout(
                    f"rank {self._rank} waited {self._state.timeout_s:.0f}s in {signature[0]} #{seq} on dim "
                    f"{channel.dim!r}: ranks {missing} never joined (collectives issued in different orders?)"
                )
            channel.cond.wait(min(remaining, 1.0))

    def _all_reduce_inplace(self, tensor: torch.Tensor, op: str, dim: str) -> torch.Tensor:
        sig = ("all_reduce", op, tuple(tensor.shape), tensor.dtype)
        result = self._exchange(dim, sig, tensor.detach(), lambda xs: _reduce(xs, op))
        with torch.no_grad():
            tensor.copy_(result)
        return tensor

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", dim: str = "dp") -> torch.Tensor:
        _check_op(op)
        if tensor.requires_grad and torch.is_grad_enabled():
            if op in ("sum", "avg"):
                return _AllReduce.apply(tensor, self, op, dim)
            return self._all_reduce_inplace(tensor.detach().clone(), op, dim)
        return self._all_reduce_inplace(tensor, op, dim)

    def all_gather(self, tensor: torch.Tensor, dim: str = "dp") -> list[torch.Tensor]:
        sig = ("all_gather", tuple(tensor.shape), tensor.dtype)
        shared = self._exchange(dim, sig, tensor.detach(), lambda xs: [x.clone() for x in xs])
        return [x.clone() for x in shared]

    def broadcast(self, tensor: torch.Tensor, src: int = 0, dim: str = "dp") -> torch.Tensor:
        n = self.size(dim)
        if not 0 <= src < n:
            raise ValueError(f"broadcast src {src} is not a group rank of dim {dim!r} (size {n})")
        sig = ("broadcast", src, tuple(tensor.shape), tensor.dtype)
        result = self._exchange(dim, sig, tensor.detach(), lambda xs: xs[src].clone())
        with torch.no_grad():
            tensor.copy_(result)
        return tensor

    def reduce_scatter(self, tensor: torch.Tensor, op: str = "sum", dim: str = "dp") -> torch.Tensor:
        _check_op(op)
        n = self.size(dim)
        if tensor.dim() == 0 or tensor.shape[0] % n:
            raise ValueError(
                f"reduce_scatter needs dim 0 divisible by the {dim!r} size {n}, got {tuple(tensor.shape)}"
            )
        sig = ("reduce_scatter", op, tuple(tensor.shape), tensor.dtype)
        result = self._exchange(dim, sig, tensor.detach(), lambda xs: _reduce(xs, op))
        chunk = tensor.shape[0] // n
        return result.narrow(0, self.rank(dim) * chunk, chunk).clone()

    def barrier(self, dim: str = "dp") -> None:
        self._exchange(dim, ("barrier",), None, lambda xs: None)

    def __repr__(self) -> str:
        coords = ", ".join(f"{d}={self.rank(d)}/{self.size(d)}" for d in ("tp", "cp", "dp", "pp", "ep"))
        return f"SimRank({self._rank}: {coords})"


def _rebuild(cls: type[Exception], msg: str) -> Exception:
    """A fresh exception per rank: one object raised from several threads would share a traceback."""
    try:
        return cls(msg)
    except Exception:  # exotic constructors
        return CollectiveError(f"{cls.__name__}: {msg}")


def _check_op(op: str) -> None:
    if op not in _OPS:
        raise ValueError(f"unknown reduce op {op!r}; expected one of {_OPS}")


class SimulatedWorld:
    """A Megatron world of `world_size` ranks split tp × cp × dp × pp (dp derived), experts ep × etp × edp × pp.

    `run(fn)` calls `fn(ps)` on every rank concurrently, `ps` being that rank's `ParallelState`.
    """

    def __init__(
        self,
        world_size: int,
        tp: int = 1,
        pp: int = 1,
        cp: int = 1,
        ep: int = 1,
        etp: int | None = None,
        timeout_s: float = 60.0,
    ) -> None:
        # Dense layout as megatron builds it (its dense generator has ep=1); experts from a second layout.
        dense = rank_groups(world_size, tp=tp, pp=pp, cp=cp, ep=1)
        expert = expert_rank_groups(world_size, tp=tp, pp=pp, ep=ep, etp=etp)
        self.world_size = world_size
        self.tp, self.pp, self.cp, self.ep = tp, pp, cp, ep
        self.etp = tp if etp is None else etp
        self.dp = world_size // (tp * pp * cp)
        self.edp = world_size // (self.etp * ep * pp)
        self.timeout_s = timeout_s
        self._groups: dict[str, list[list[int]]] = {
            "tp": dense["tp"],
            "pp": dense["pp"],
            "dp": dense["dp"],
            "cp": dense["cp"],
            "dp_cp": dense["dp_cp"],
            "mp": dense["mp"],
            "tp_dp_cp": dense["tp_dp_cp"],
            "ep": expert["ep"],
            "etp": expert["etp"],
            "edp": expert["edp"],
        }
        self._where_cache = {dim: rank_of(g, world_size) for dim, g in self._groups.items()}

    def groups(self, dim: str) -> list[list[int]]:
        """All groups along `dim` (megatron's enumeration order), each in group-rank order."""
        if dim not in self._groups:
            raise ValueError(f"unknown parallel dim {dim!r}; expected one of {SIM_DIMS}")
        return [list(g) for g in self._groups[dim]]

    def size(self, dim: str) -> int:
        if dim not in self._groups:
            raise ValueError(f"unknown parallel dim {dim!r}; expected one of {SIM_DIMS}")
        return len(self._groups[dim][0])

    def _where(self, dim: str) -> list[tuple[int, int]]:
        if dim not in self._where_cache:
            raise ValueError(f"unknown parallel dim {dim!r}; expected one of {SIM_DIMS}")
        return self._where_cache[dim]

    def run(self, fn: Callable[[SimRank], T]) -> list[T]:
        """Run `fn` on every rank concurrently; results in global-rank order. Any rank's exception propagates."""
        state = _RunState(self)
        views = [SimRank(self, state, r) for r in range(self.world_size)]
        results: list[Any] = [None] * self.world_size
        errors: list[tuple[int, BaseException]] = []
        lock = threading.Lock()

        def body(rank: int) -> None:
            try:
                results[rank] = fn(views[rank])
            except BaseException as e:  # noqa: BLE001 - re-raised by run() in the caller's thread
                with lock:
                    errors.append((rank, e))
                state.abort()
            finally:
                state.mark_finished(rank)

        threads = [
            threading.Thread(target=body, args=(r,), name=f"sim-rank-{r}", daemon=True) for r in range(self.world_size)
        ]
        for t in threads:
            t.start()
        # A rank stuck outside collectives is not ours to interrupt; give up waiting after a generous bound.
        deadline = time.monotonic() + 4 * self.timeout_s
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        stuck = [r for r, t in enumerate(threads) if t.is_alive()]
        if stuck:
            state.abort()
            raise CollectiveTimeout(f"simulated ranks {stuck} did not return within {4 * self.timeout_s:.0f}s")
        if errors:
            primary = [(r, e) for r, e in errors if not isinstance(e, SimulationAborted)] or errors
            rank, exc = primary[0]
            exc.add_note(f"raised on simulated rank {rank} of {self.world_size}")
            raise exc
        return results

    def __repr__(self) -> str:
        return (
            f"SimulatedWorld(world_size={self.world_size}, tp={self.tp}, pp={self.pp}, cp={self.cp}, "
            f"dp={self.dp}, ep={self.ep}, etp={self.etp}, edp={self.edp})"
        )
