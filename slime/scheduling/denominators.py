"""Per-group masked-token totals D_g, computed on the rollout side (docs/algorithms.md#loss-normalisation).

Why precomputed: a group's samples may be spread over micro-batches, DP ranks and CP chunks, so no trainer
rank can see all of a group's tokens. Every rank divides its partial sums by the same global D_g, and the
partial sums then add up exactly to the group's token mean. Groups never span optimizer steps (see
`schedule.py`), so computing D_g over a whole rollout equals computing it per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def sample_loss_mask(sample: Any) -> list[int]:
    """The response loss mask; slime's default when unset is all ones over the response."""
    return list(sample.loss_mask) if sample.loss_mask is not None else [1] * sample.response_length


def group_mask_sums(loss_masks: Sequence[Sequence[int]], group_ids: Sequence[int]) -> list[int]:
    """D_{g(i)} = sum of mask over every sample of i's group, broadcast to each sample i."""
    if len(loss_masks) != len(group_ids):
        raise ValueError(f"{len(loss_masks)} loss masks but {len(group_ids)} group ids")
    totals: dict[int, int] = {}
    per_sample = [int(sum(m)) for m in loss_masks]
    for g, n in zip(group_ids, per_sample, strict=True):
        totals[g] = totals.get(g, 0) + n
    return [totals[g] for g in group_ids]


def sample_mask_sums(loss_masks: Sequence[Sequence[int]]) -> list[int]:
    """Per-sample masked-token totals (the per-token mode's normaliser counts max(this, 1) per sample)."""
    return [int(sum(m)) for m in loss_masks]
