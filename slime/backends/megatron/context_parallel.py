"""Context parallelism for slime's packed rows: which rows a CP rank runs, exact attention across the CP group,
and per-response values moved between the CP-local and the whole-sample view.

The layout. A packed micro-batch is one THD row (packing.py) padded to a multiple of 2·cp; the row is cut into
2·cp equal chunks and CP rank r runs chunks r and 2·cp−1−r (`cp_slicing.zigzag_chunk_ranges` over the whole
row). That is exactly what megatron-core's THD RoPE does to a per-token angle table when `cu_seqlens` is one
segment spanning the row, which is how slime's rows are described to megatron (packing.py, rope.py): the
positions stay the row's own, so shared-prompt branches keep their positions. Zigzag over the whole row rather
than per sample: the row's segments form a tree (a shared prompt, then branches), and one row-level cut needs
no per-sample padding; a long trajectory alone in its micro-batch gets the classic per-sample zigzag.

The attention. Queries stay local; keys and values are all-gathered over the CP group (`gather_over_cp`, whose
backward sums every rank's gradient of its own rows), then each local query attends under the row's segment
rules (attention.py): causal within its segment, plus the whole shared prompt for a branch. Every logit row is
then the one a single-rank forward computes.

The losses. Response token j of sample i is scored on the rank that runs the row predicting it
(`local_response_rows`); those index sets partition each response over the CP ranks, so the reducers' partial
sums (divided by global group totals) add up over "dp_cp" as they already do (reducers.py). The no-grad
log-prob passes gather the scores back to whole responses in sample order (`gather_responses`), so advantages,
the post-process hook and rollout-side comparisons see whole samples; `whole_sample_state` is the
`ParallelState` to use there (the CP ranks of one DP rank hold the same whole samples).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from slime.algorithms.cp_slicing import zigzag_chunk_ranges
from slime.parallel_state import ParallelState

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CPShard:
    """What a CP rank needs about its share of a packed row (kept on the row's `PackedSeqParams`)."""

    group: Any  # the CP process group
    size: int
    rank: int
    total_len: int  # the whole row, a multiple of 2 * size
    chunks: tuple[tuple[int, int], ...]  # [start, end) of this rank's chunks in the row, in local order

    @property
    def chunk_len(self) -> int:
        return self.total_len // (2 * self.size)

    def local_pieces(self) -> list[tuple[int, int, int]]:
        """(row start, row end, local start) of each chunk."""
        out, local = [], 0
        for s, e in self.chunks:
            out.append((s, e, local))
            local += e - s
        return out


def shard_row_for_cp(packed: Any, ps: ParallelState) -> Any:
    """Give `packed` (a PackedBatch) this rank's CP share: `cp_rows` (row indices run here, in local order)
    and a `CPShard` on its params. The row's tokens and positions stay whole: targets are read from them."""
    size, rank = ps.size("cp"), ps.rank("cp")
    total = packed.total_len
    if total % (2 * size):
        raise ValueError(f"a packed row of {total} tokens does not split into 2 x cp={size} equal chunks")
    chunks = tuple(zigzag_chunk_ranges(total, size, rank))
    shard = CPShard(group=ps.group("cp"), size=size, rank=rank, total_len=total, chunks=chunks)
    dev = packed.tokens.device
    packed.cp_rows = torch.cat([torch.arange(s, e, device=dev) for s, e in chunks])
    packed.packed_seq_params._slime_cp = shard
    return packed


class _GatherOverCP(torch.autograd.Function):
    """All-gather the local rows of a tensor [T_local, ...] into the whole row [T, ...] (row order).

    Backward: rank r's loss depends on every rank's rows through the gathered keys and values, so the gradient
    of a local row is the sum over ranks of their gradient for it (a reduce-scatter; gloo has none, so an
    all-reduce of the whole-row gradient and a slice).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, shard: CPShard) -> torch.Tensor:  # type: ignore[override]
        ctx.shard = shard
        parts = [torch.empty_like(x) for _ in range(shard.size)]
        dist.all_gather(parts, x.contiguous(), group=shard.group)
        half = shard.chunk_len
        chunks: list[torch.Tensor | None] = [None] * (2 * shard.size)
        for r, part in enumerate(parts):
            chunks[r], chunks[2 * shard.size - 1 - r] = part[:half], part[half:]
        return torch.cat(chunks, dim=0)  # type: ignore[arg-type]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        shard: CPShard = ctx.shard
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=shard.group)
        return torch.cat([grad[s:e] for s, e in shard.chunks], dim=0), None


def gather_over_cp(x: torch.Tensor, shard: CPShard) -> torch.Tensor:
    """The whole row of a per-row tensor whose local rows this rank holds (differentiable)."""
    return _GatherOverCP.apply(x, shard)


def local_response_rows(
    packed: Any, response_lengths: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Which response tokens this CP rank scores, and where.

    Returns (local logits rows, target rows of the whole row, per-sample response indices j), in sample
    order: token j of sample i is scored here iff the row predicting it is one of this rank's rows. Without CP
    (`packed.cp_rows` None) every token is.
    """
    dev = packed.tokens.device
    lookup = None
    if packed.cp_rows is not None:
        lookup = torch.full((packed.total_len,), -1, dtype=torch.long, device=dev)
        lookup[packed.cp_rows] = torch.arange(packed.cp_rows.numel(), device=dev)
    preds, targets, picked = [], [], []
    for i, resp in enumerate(response_lengths):
        rows = packed.sample_rows(i, last=resp + 1)
        if not 0 <= resp < max(len(rows), 1):
            raise ValueError(f"response length {resp} needs a prompt token before it ({len(rows)} tokens)")
        rows_t = torch.tensor(rows, dtype=torch.long, device=dev)
        pred, tgt = rows_t[:-1], rows_t[1:]  # rows[j] predicts rows[j + 1], response token j
        if lookup is None:
            js = torch.arange(resp, device=dev)
        else:
            local = lookup[pred]
            js = torch.nonzero(local >= 0, as_tuple=True)[0]
            pred = local[js]
            tgt = tgt[js]
        preds.append(pred)
        targets.append(tgt)
        picked.append(js)
    empty = torch.empty(0, dtype=torch.long, device=dev)
    return (torch.cat(preds) if preds else empty), (torch.cat(targets) if targets else empty), picked


def gather_responses(
    local: Sequence[torch.Tensor], picked: Sequence[torch.Tensor], response_lengths: Sequence[int], ps: ParallelState
) -> list[torch.Tensor]:
    """Whole per-sample responses from each CP rank's scored tokens (`local_response_rows`), in sample order.

    The index sets of the CP ranks partition every response, so a scatter into zeros and one sum all-reduce
    over "cp" rebuild them exactly.
    """
    n = sum(response_lengths)
    dtype = local[0].dtype if local else torch.float32
    device = local[0].device if local else torch.device("cpu")
    flat = torch.zeros(n, dtype=dtype, device=device)
    base = 0
    for x, js, resp in zip(local, picked, response_lengths, strict=True):
        if js.numel():
            flat[js.to(device) + base] = x.detach().to(dtype)
        base += resp
    ps.all_reduce(flat, "sum", "cp")
    return list(flat.split(list(response_lengths)))


def local_part(values: Sequence[torch.Tensor], picked: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """This rank's entries of whole per-sample response tensors (the inverse view of `gather_responses`)."""
    out = []
    for v, js in zip(values, picked, strict=True):
        v = torch.as_tensor(v)
        out.append(v.index_select(0, js.to(v.device)) if js.numel() != v.shape[0] else v)
    return out


class _WholeSampleState:
    """A `ParallelState` for code that runs on whole samples while CP > 1: "cp" has size 1 and "dp_cp" is "dp".

    After `gather_responses` every CP rank of a DP rank holds the same whole samples, so a reduction over CP
    would count them cp times; over DP alone it sees each sample once, as a CP=1 run does.
    """

    _ALIAS = {"cp": None, "dp_cp": "dp"}

    def __init__(self, inner: ParallelState) -> None:
        self._inner = inner

    @property
    def global_rank(self) -> int:
        return self._inner.global_rank

    @property
    def world_size(self) -> int:
        return self._inner.world_size

    def _dim(self, dim: str) -> str | None:
        return self._ALIAS.get(dim, dim)

    def size(self, dim: str) -> int:
        d = self._dim(dim)
        return 1 if d is None else self._inner.size(d)  # type: ignore[arg-type]

    def rank(self, dim: str) -> int:
        d = self._dim(dim)
        return 0 if d is None else self._inner.rank(d)  # type: ignore[arg-type]

    def group(self, dim: str) -> Any:
        d = self._dim(dim)
        return None if d is None else self._inner.group(d)  # type: ignore[arg-type]

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", dim: str = "dp") -> torch.Tensor:
        d = self._dim(dim)
        return tensor if d is None else self._inner.all_reduce(tensor, op, d)  # type: ignore[arg-type]

    def all_gather(self, tensor: torch.Tensor, dim: str = "dp") -> list[torch.Tensor]:
        d = self._dim(dim)
        return [tensor.detach().clone()] if d is None else self._inner.all_gather(tensor, d)  # type: ignore[arg-type]

    def broadcast(self, tensor: torch.Tensor, src: int = 0, dim: str = "dp") -> torch.Tensor:
        d = self._dim(dim)
        return tensor if d is None else self._inner.broadcast(tensor, src, d)  # type: ignore[arg-type]

    def reduce_scatter(self, tensor: torch.Tensor, op: str = "sum", dim: str = "dp") -> torch.Tensor:
        d = self._dim(dim)
        return tensor if d is None else self._inner.reduce_scatter(tensor, op, d)  # type: ignore[arg-type]

    def barrier(self, dim: str = "dp") -> None:
        d = self._dim(dim)
        if d is not None:
            self._inner.barrier(d)  # type: ignore[arg-type]


def whole_sample_state(ps: ParallelState) -> ParallelState:
    """`ps` itself without CP; with CP the view above."""
    return ps if ps.size("cp") == 1 else _WholeSampleState(ps)  # type: ignore[return-value]
