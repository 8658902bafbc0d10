"""Pack a micro-batch of samples into one THD row for megatron-core, and split per-token outputs back.

Why packing: RL micro-batches mix very different lengths; concatenating them into one row with
`cu_seqlens` boundaries wastes no compute on padding (slime's `--qkv-format thd`). Exactness rests on two
things megatron and slime's core attention do per segment: RoPE positions restart at 0
(`_apply_rotary_pos_emb_thd`) and attention is causal within a segment only (`SDPACoreAttention`). So a
packed forward gives each sample the same logits as a forward of that sample alone.

Padding (to a multiple of `pad_multiple`, e.g. tp size with sequence parallelism) is appended as one extra
segment of `pad_token_id`: it attends only to itself and no sample attends to it. Context parallelism is
not handled here (the SDPA core attention requires cp == 1).

    packed = pack_samples([s.tokens for s in micro_batch], pad_multiple=tp)
    logits = model(packed.tokens, packed.position_ids, None, packed_seq_params=packed.packed_seq_params)
    per_sample = unpack_logits(gathered_logits, packed, vocab_size=spec.vocab_size)   # list of [L_i, V]
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from megatron.core.packed_seq_params import PackedSeqParams

logger = logging.getLogger(__name__)


@dataclass
class PackedBatch:
    tokens: torch.Tensor  # [1, T] int64, T = sum(lengths) + pad
    position_ids: torch.Tensor  # [1, T], restarting at 0 for every sample (and for the pad segment)
    cu_seqlens: torch.Tensor  # [n + 1] or [n + 2] int32: sample boundaries (+ the pad segment's end)
    packed_seq_params: PackedSeqParams
    lengths: list[int]
    pad: int

    @property
    def total_len(self) -> int:
        return int(self.tokens.size(1))


def pack_samples(
    samples: Sequence[Sequence[int] | torch.Tensor],
    pad_multiple: int = 1,
    pad_token_id: int = 0,
    device: torch.device | str | None = None,
) -> PackedBatch:
    """Concatenate token sequences into one row with `cu_seqlens` and megatron's `PackedSeqParams` (THD)."""
    if not samples:
        raise ValueError("cannot pack an empty micro-batch")
    seqs = [torch.as_tensor(s, dtype=torch.long).reshape(-1) for s in samples]
    lengths = [int(s.numel()) for s in seqs]
    total = sum(lengths)
    padded = -(-max(total, 1) // pad_multiple) * pad_multiple
    pad = padded - total
    segments = lengths + ([pad] if pad else [])
    tokens = torch.cat(seqs + [torch.full((pad,), pad_token_id, dtype=torch.long)])
    positions = torch.cat([torch.arange(n, dtype=torch.long) for n in segments])
    cu = torch.zeros(len(segments) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(segments, dtype=torch.int32), dim=0)
    if device is not None:
        tokens, positions, cu = tokens.to(device), positions.to(device), cu.to(device)
    max_len = max(segments)
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=max_len,
        max_seqlen_kv=max_len,
    )
    return PackedBatch(
        tokens=tokens.unsqueeze(0),
        position_ids=positions.unsqueeze(0),
        cu_seqlens=cu,
        packed_seq_params=params,
        lengths=lengths,
        pad=pad,
    )


def unpack(values: torch.Tensor, packed: PackedBatch) -> list[torch.Tensor]:
    """Split a per-token tensor of the packed row ([1, T, ...] or [T, ...]) into per-sample views."""
    if values.dim() >= 2 and values.size(0) == 1 and values.size(1) == packed.total_len:
        values = values.squeeze(0)
    if values.size(0) != packed.total_len:
        raise ValueError(f"expected {packed.total_len} positions, got shape {tuple(values.shape)}")
    return list(torch.split(values, packed.lengths + [packed.pad], dim=0)[: len(packed.lengths)])


def unpack_logits(logits: torch.Tensor, packed: PackedBatch, vocab_size: int | None = None) -> list[torch.Tensor]:
    """Per-sample `[L_i, V]` logits; `vocab_size` crops the TP padding columns (see hf_config)."""
    parts = unpack(logits, packed)
    return [p[..., :vocab_size] for p in parts] if vocab_size is not None else parts
