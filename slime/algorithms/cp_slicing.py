"""Zigzag context-parallel slicing of samples and of packed (THD) micro-batches, and its inverse.

Why zigzag: with causal attention, late positions attend to more keys than early ones. Cutting a
sequence into 2*cp equal chunks and giving CP rank r chunks r and 2*cp-1-r pairs a cheap chunk with an
expensive one, so every rank does the same attention work. This is the layout Megatron/TransformerEngine
expect for `qkv_format="thd"` with context parallelism (slime: `backends/megatron_utils/cp_utils.py`).

Loss reduction over CP ranks: each rank sums only the response tokens whose predicting position lies in
its chunks (`response_ranges_for_cp`) but divides by the sample's (or group's) *global* mask sum, so the
CP partial sums add up to exactly the unsliced value.
"""

from __future__ import annotations

import itertools
import logging

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)


def _check_cp(cp_size: int, cp_rank: int | None = None) -> None:
    if cp_size < 1:
        raise ValueError(f"cp_size must be >= 1, got {cp_size}")
    if cp_rank is not None and not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} out of range for cp_size {cp_size}")


def cp_pad_len(total_len: int, cp_size: int) -> int:
    """`total_len` rounded up to a multiple of 2*cp_size (the length that splits into 2*cp equal chunks)."""
    _check_cp(cp_size)
    if total_len < 0:
        raise ValueError(f"total_len must be >= 0, got {total_len}")
    unit = 2 * cp_size
    return -(-total_len // unit) * unit


def zigzag_chunk_ranges(total_len: int, cp_size: int, cp_rank: int) -> list[tuple[int, int]]:
    """The two [start, end) ranges, in the padded sequence, held by `cp_rank` (front chunk first)."""
    _check_cp(cp_size, cp_rank)
    chunk = cp_pad_len(total_len, cp_size) // (2 * cp_size)
    back = 2 * cp_size - 1 - cp_rank
    return [(cp_rank * chunk, (cp_rank + 1) * chunk), (back * chunk, (back + 1) * chunk)]


def slice_for_cp(x: torch.Tensor, cp_size: int, cp_rank: int, dim: int = 0, pad_value: float = 0) -> torch.Tensor:
    """This rank's two zigzag chunks of `x` along `dim`, concatenated (after right-padding with `pad_value`)."""
    _check_cp(cp_size, cp_rank)
    dim = dim % x.dim()
    total_len = x.shape[dim]
    padded = cp_pad_len(total_len, cp_size)
    if padded != total_len:
        # F.pad lists (left, right) pairs from the last dim backwards.
        pad = [0, 0] * (x.dim() - 1 - dim) + [0, padded - total_len]
        x = F.pad(x, pad, value=pad_value)
    return torch.cat([x.narrow(dim, s, e - s) for s, e in zigzag_chunk_ranges(total_len, cp_size, cp_rank)], dim=dim)


def unslice_from_cp(parts: list[torch.Tensor], total_len: int, cp_size: int, dim: int = 0) -> torch.Tensor:
    """Inverse of `slice_for_cp`: `parts[r]` is rank r's slice; returns the sequence without padding."""
    _check_cp(cp_size)
    if len(parts) != cp_size:
        raise ValueError(f"expected {cp_size} CP parts, got {len(parts)}")
    dim = dim % parts[0].dim()
    chunk = cp_pad_len(total_len, cp_size) // (2 * cp_size)
    chunks: list[torch.Tensor | None] = [None] * (2 * cp_size)
    for r, part in enumerate(parts):
        if part.shape[dim] != 2 * chunk:
            raise ValueError(f"CP part {r} has length {part.shape[dim]} along dim {dim}, expected {2 * chunk}")
        chunks[r], chunks[2 * cp_size - 1 - r] = part.narrow(dim, 0, chunk), part.narrow(dim, chunk, chunk)
    return torch.cat(chunks, dim=dim).narrow(dim, 0, total_len)  # type: ignore[arg-type]


def response_ranges_for_cp(total_len: int, response_len: int, cp_size: int, cp_rank: int) -> list[tuple[int, int]]:
    """Ranges of response-token indices j whose predicting position lies in this rank's chunks.

    Logits at position t predict token t+1, so response token j is predicted at position prompt_len-1+j.
    The ranges of all CP ranks partition range(response_len); empty ranges are dropped.
    """
    _check_cp(cp_size, cp_rank)
    prompt_len = total_len - response_len
    if response_len < 0 or prompt_len < 1:
        raise ValueError(f"need 0 <= response_len < total_len (a prompt token), got {response_len}, {total_len}")
    first, last = prompt_len - 1, total_len - 1  # predicting positions of response tokens: [first, last)
    ranges = []
    for start, end in zigzag_chunk_ranges(total_len, cp_size, cp_rank):
        lo, hi = max(start, first), min(end, last)
        if lo < hi:
            ranges.append((lo - first, hi - first))
    return ranges


def slice_response_for_cp(
    x: torch.Tensor, total_len: int, response_len: int, cp_size: int, cp_rank: int, dim: int = 0
) -> torch.Tensor:
    """This rank's part of a per-response-token array (log-probs, advantages, loss mask) along `dim`."""
    if x.shape[dim] != response_len:
        raise ValueError(f"expected length {response_len} along dim {dim}, got {x.shape[dim]}")
    ranges = response_ranges_for_cp(total_len, response_len, cp_size, cp_rank)
    if not ranges:
        return x.narrow(dim, 0, 0)
    return torch.cat([x.narrow(dim, s, e - s) for s, e in ranges], dim=dim)


def unslice_response_from_cp(
    parts: list[torch.Tensor], total_len: int, response_len: int, cp_size: int, dim: int = 0
) -> torch.Tensor:
    """Inverse of `slice_response_for_cp` over all CP ranks."""
    _check_cp(cp_size)
    if len(parts) != cp_size:
        raise ValueError(f"expected {cp_size} CP parts, got {len(parts)}")
    pieces: list[tuple[int, torch.Tensor]] = []
    for r, part in enumerate(parts):
        ranges = response_ranges_for_cp(total_len, response_len, cp_size, r)
        sizes = [e - s for s, e in ranges]
        if part.shape[dim] != sum(sizes):
            raise ValueError(f"CP part {r} has length {part.shape[dim]} along dim {dim}, expected {sum(sizes)}")
        pieces.extend(zip((s for s, _ in ranges), part.split(sizes, dim=dim), strict=True))
    if not pieces:
        return parts[0].narrow(dim, 0, 0)
    return torch.cat([t for _, t in sorted(pieces, key=lambda p: p[0])], dim=dim)


def _lengths(cu_seqlens: torch.Tensor | list[int]) -> list[int]:
    cu = [int(v) for v in cu_seqlens]
    if not cu or cu[0] != 0 or any(b < a for a, b in itertools.pairwise(cu)):
        raise ValueError(f"cu_seqlens must start at 0 and be non-decreasing, got {cu}")
    return [b - a for a, b in itertools.pairwise(cu)]


def slice_packed_for_cp(
    tokens: torch.Tensor, cu_seqlens: torch.Tensor | list[int], cp_size: int, cp_rank: int, pad_value: float = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Zigzag-slice every sample of a packed micro-batch (samples concatenated along dim 0).

    Returns (local_tokens, padded_cu_seqlens). Each sample is padded to a multiple of 2*cp and sliced on
    its own, so local_tokens holds padded_len/cp tokens per sample. padded_cu_seqlens are the boundaries
    of the *padded full* sequence (= local boundaries × cp_size): what `PackedSeqParams` takes under CP,
    as in slime's `get_batch`.
    """
    _check_cp(cp_size, cp_rank)
    lengths = _lengths(cu_seqlens)
    if sum(lengths) != tokens.shape[0]:
        raise ValueError(f"cu_seqlens cover {sum(lengths)} tokens but tokens has {tokens.shape[0]}")
    samples = tokens.split(lengths, dim=0)
    local = [slice_for_cp(s, cp_size, cp_rank, dim=0, pad_value=pad_value) for s in samples]
    padded_cu = [0]
    for n in lengths:
        padded_cu.append(padded_cu[-1] + cp_pad_len(n, cp_size))
    out = torch.cat(local, dim=0) if local else tokens.new_empty((0, *tokens.shape[1:]))
    return out, torch.tensor(padded_cu, dtype=torch.int32)


def unslice_packed_from_cp(
    parts: list[torch.Tensor], cu_seqlens: torch.Tensor | list[int], cp_size: int
) -> torch.Tensor:
    """Inverse of `slice_packed_for_cp`: `parts[r]` is rank r's local tokens, `cu_seqlens` the original ones."""
    _check_cp(cp_size)
    if len(parts) != cp_size:
        raise ValueError(f"expected {cp_size} CP parts, got {len(parts)}")
    lengths = _lengths(cu_seqlens)
    local_lens = [cp_pad_len(n, cp_size) // cp_size for n in lengths]
    per_rank = [p.split(local_lens, dim=0) for p in parts]
    samples = [unslice_from_cp([per_rank[r][i] for r in range(cp_size)], n, cp_size) for i, n in enumerate(lengths)]
    return torch.cat(samples, dim=0) if samples else parts[0].new_empty((0, *parts[0].shape[1:]))
