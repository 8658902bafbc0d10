"""Pack a micro-batch of samples into one THD row for megatron-core, and map per-token outputs back.

Why packing: RL micro-batches mix very different lengths; concatenating them into one row wastes no compute on
padding (slime's `--qkv-format thd`).

Why prompt sharing (`prompt_lengths`, `--share-prompt-prefix`): GRPO samples `--n-samples-per-prompt` answers
per prompt, so a micro-batch holds the same prompt many times. Samples whose prompt tokens are identical are
packed as a tree: the prompt once, then each sample's response as a branch that attends to the whole prompt
and causally to itself, with positions continuing after the prompt. Every linear layer then runs on the prompt
once instead of n times (the toy task: 34 tokens per sample, 26 of them prompt). It is exact: each sample
sees the same keys, values and positions as in a forward of that sample alone.

Exactness of both layouts rests on two things the row carries for slime's modules:
- `_slime_positions` (per-token RoPE positions), read by `rope.PositionalRotaryEmbedding`;
- `_slime_segments` (who attends to whom), read by `attention.SDPACoreAttention`.
Megatron's own `cu_seqlens` in the `PackedSeqParams` is then one segment spanning the row: its THD RoPE walks
`cu_seqlens` segment by segment, and with per-token angles one segment gives the same result in one op.
`PackedBatch.cu_seqlens` keeps the row's true segment boundaries for readers.

Padding (to a multiple of `pad_multiple`, e.g. tp size with sequence parallelism) is appended as one extra
segment of `pad_token_id`: it attends only to itself and no sample attends to it. With context parallelism
the row is padded to a multiple of 2·cp and each CP rank runs its zigzag chunks of it (`cp_rows`, set by
context_parallel.py); `model_inputs()` gives the model those rows.

    packed = pack_samples(tokens, pad_multiple=tp, prompt_lengths=[t - r for t, r in zip(totals, responses)])
    logits = model(packed.tokens, packed.position_ids, None, packed_seq_params=packed.packed_seq_params)
    per_sample = unpack_logits(gathered_logits, packed, vocab_size=spec.vocab_size)   # list of [L_i, V]
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from megatron.core.packed_seq_params import PackedSeqParams

logger = logging.getLogger(__name__)

# One attention segment of the row: queries [q_start, q_start + length) attend causally to themselves and,
# for a branch, to all of the shared prompt [prefix_start, prefix_start + prefix_len) before them.
Segment = tuple[int, int, int, int]  # (q_start, length, prefix_start, prefix_len)


@dataclass
class PackedBatch:
    tokens: torch.Tensor  # [1, T] int64, T = packed tokens + pad
    position_ids: torch.Tensor  # [1, T]: each sample's own positions (a branch continues after its prompt)
    cu_seqlens: torch.Tensor  # int32 boundaries of the row's segments in row order (samples, prompts, branches, pad)
    packed_seq_params: PackedSeqParams
    lengths: list[int]  # per sample: prompt + response tokens (as if unshared)
    pad: int
    # per sample (prefix_start, prefix_len, own_start, own_len): its tokens are the rows of the shared prompt
    # followed by its own rows; prefix_len is 0 for a sample packed whole
    layout: list[tuple[int, int, int, int]]
    # context parallelism: the row indices this rank runs, in local order (context_parallel.shard_row_for_cp)
    cp_rows: torch.Tensor | None = None

    def model_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, position_ids) [1, T_local] the model runs on: the whole row, or this CP rank's rows."""
        if self.cp_rows is None:
            return self.tokens, self.position_ids
        return self.tokens[:, self.cp_rows], self.position_ids[:, self.cp_rows]

    @property
    def total_len(self) -> int:
        return int(self.tokens.size(1))

    @property
    def shared(self) -> bool:
        return any(p for _, p, _, _ in self.layout)

    def sample_rows(self, i: int, last: int | None = None) -> list[int]:
        """Row of each of sample i's tokens, in order (length `lengths[i]`); with `last`, of its last `last`
        tokens only, so a reader of the response does not list a long shared prompt's rows per sample."""
        ps, pl, os_, ol = self.layout[i]
        n = pl + ol if last is None else min(max(last, 0), pl + ol)
        from_prompt = max(n - ol, 0)
        return [*range(ps + pl - from_prompt, ps + pl), *range(os_ + ol - (n - from_prompt), os_ + ol)]


def _prompt_groups(seqs: list[list[int]], prompt_lengths: Sequence[int] | None) -> list[list[int]]:
    """Sample indices in packing order: samples with an identical non-empty prompt together, first-seen order."""
    if prompt_lengths is None:
        return [[i] for i in range(len(seqs))]
    if len(prompt_lengths) != len(seqs):
        raise ValueError(f"{len(prompt_lengths)} prompt lengths for {len(seqs)} samples")
    groups: dict[tuple[int, ...] | int, list[int]] = {}
    for i, (s, p) in enumerate(zip(seqs, prompt_lengths, strict=True)):
        if not 0 <= p <= len(s):
            raise ValueError(f"sample {i}: prompt length {p} outside [0, {len(s)}]")
        key = tuple(s[:p]) if p > 0 else i  # an empty prompt shares nothing
        groups.setdefault(key, []).append(i)
    return list(groups.values())


def row_pad_multiple(multiplier: int, cp: int, sp: int) -> int:
    """The least row length multiple that serves `--data-pad-size-multiplier` and the layout: with sequence
    parallelism megatron splits a row over the `sp` TP ranks; with context parallelism each of the `cp` ranks
    runs two equal chunks of it (context_parallel.py), each again split over TP under SP."""
    return math.lcm(multiplier, 2 * cp * sp if cp > 1 else sp)


def pack_samples(
    samples: Sequence[Sequence[int] | torch.Tensor],
    pad_multiple: int = 1,
    pad_token_id: int = 0,
    device: torch.device | str | None = None,
    prompt_lengths: Sequence[int] | None = None,
    pad_to: int | None = None,
) -> PackedBatch:
    """One THD row of the samples; with `prompt_lengths`, samples with an identical prompt share its rows.

    The row is assembled in Python lists and turned into tensors once: a micro-batch holds hundreds of
    samples, and per-sample tensor ops would cost more than the packing itself. `pad_to` pads the row to exactly
    that many tokens (a multiple of `pad_multiple`): megatron's interleaved pipeline schedule needs one row
    length for every micro-batch of a step.
    """
    if not samples:
        raise ValueError("cannot pack an empty micro-batch")
    seqs = [s.reshape(-1).tolist() if isinstance(s, torch.Tensor) else list(s) for s in samples]
    tokens: list[int] = []
    positions: list[int] = []
    segments: list[Segment] = []
    layout: list[tuple[int, int, int, int]] = [(0, 0, 0, 0)] * len(seqs)

    def emit(piece: list[int], first_pos: int, prefix: tuple[int, int]) -> int:
        start = len(tokens)
        tokens.extend(piece)
        positions.extend(range(first_pos, first_pos + len(piece)))
        if piece:  # an empty response is an empty branch: no segment
            segments.append((start, len(piece), *prefix))
        return start

    for group in _prompt_groups(seqs, prompt_lengths):
        if len(group) == 1:
            i = group[0]
            layout[i] = (0, 0, emit(seqs[i], 0, (0, 0)), len(seqs[i]))
            continue
        p = int(prompt_lengths[group[0]])  # type: ignore[index]
        ps = emit(seqs[group[0]][:p], 0, (0, 0))
        for i in group:
            layout[i] = (ps, p, emit(seqs[i][p:], p, (ps, p)), len(seqs[i]) - p)
    total = len(tokens)
    padded = -(-max(total, 1) // pad_multiple) * pad_multiple
    if pad_to is not None:
        if pad_to < padded or pad_to % pad_multiple:
            raise ValueError(f"pad_to {pad_to} is below the row's {padded} tokens or not a multiple of {pad_multiple}")
        padded = pad_to
    pad = padded - total
    emit([pad_token_id] * pad, 0, (0, 0))
    bounds = [start for start, _, _, _ in segments] + [padded]
    dev = torch.device(device) if device is not None else None
    tok = torch.tensor(tokens, dtype=torch.long, device=dev)
    pos = torch.tensor(positions, dtype=torch.long, device=dev)
    cu = torch.tensor(bounds, dtype=torch.int32, device=dev)
    whole = torch.tensor([0, padded], dtype=torch.int32, device=dev)
    max_len = max(n + p for _, n, _, p in segments)
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=whole, cu_seqlens_kv=whole, max_seqlen_q=max_len, max_seqlen_kv=max_len
    )
    # megatron's dataclass has no slots: plain attributes, read by slime's RoPE and core attention
    params._slime_positions = pos
    params._slime_segments = segments
    return PackedBatch(
        tokens=tok.unsqueeze(0),
        position_ids=pos.unsqueeze(0),
        cu_seqlens=cu,
        packed_seq_params=params,
        lengths=[len(s) for s in seqs],
        pad=pad,
        layout=layout,
    )


def unpack(values: torch.Tensor, packed: PackedBatch) -> list[torch.Tensor]:
    """Per-sample values of a per-token tensor of the row ([1, T, ...] or [T, ...]), each `[L_i, ...]`.

    Samples packed whole come back as views; a sample sharing a prompt comes back as a copy (prompt rows
    followed by its branch rows), so the shared prompt's values appear in every sibling.
    """
    if values.dim() >= 2 and values.size(0) == 1 and values.size(1) == packed.total_len:
        values = values.squeeze(0)
    if values.size(0) != packed.total_len:
        raise ValueError(f"expected {packed.total_len} positions, got shape {tuple(values.shape)}")
    out = []
    for ps, pl, os_, ol in packed.layout:
        own = values[os_ : os_ + ol]
        out.append(torch.cat([values[ps : ps + pl], own]) if pl else own)
    return out


def unpack_logits(logits: torch.Tensor, packed: PackedBatch, vocab_size: int | None = None) -> list[torch.Tensor]:
    """Per-sample `[L_i, V]` logits; `vocab_size` crops the TP padding columns (see hf_config)."""
    parts = unpack(logits, packed)
    return [p[..., :vocab_size] for p in parts] if vocab_size is not None else parts
