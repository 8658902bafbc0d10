"""Turning one agent trajectory into training samples.

For now: `fan_out_sample_segments`, which emits one `Sample` per token segment (sub-agent calls, pre/post
context compaction) while keeping them one training group. The loss normaliser then treats the group as one
long sample split into segments (spec §5.3), and GRPO statistics count the trajectory once (spec §5.4).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from slime.utils.types import Sample, Status

logger = logging.getLogger(__name__)

FAN_OUT_REWARD_MODES = ("full", "split")


@dataclass(frozen=True)
class TokenSegment:
    """One contiguous context: the prompt ids it was generated from and its response (mask 0 = not trained)."""

    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int] | None = None
    rollout_log_probs: list[float] | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)


def fan_out_sample_segments(
    sample: Sample,
    segments: Sequence[TokenSegment],
    reward: float | dict[str, Any],
    *,
    mode: str = "full",
    tokenizer: Any = None,
    metadata: Mapping[str, Any] | None = None,
) -> list[Sample]:
    """One Sample per segment sharing the trajectory's group id, annotated `segment_idx` / `num_segments`.

    `mode` is `--fan-out-reward`: `full` (default) gives every segment the trajectory's reward, consistent
    with "one long sample" and with advantages inherited per trajectory; `split` gives reward/K (slime
    v0.3.0), which only matters when rewards are used unnormalised. The first segment reuses `sample`; the
    others are copies, so caller-owned lists and dicts are never shared between siblings.
    """
    if mode not in FAN_OUT_REWARD_MODES:
        raise ValueError(f"--fan-out-reward must be one of {FAN_OUT_REWARD_MODES}, got {mode!r}")
    if not segments:
        raise ValueError("fan_out_sample_segments needs at least one segment")
    group_id = sample.group_id if sample.group_id is not None else sample.index
    if group_id is None:
        raise ValueError("fan_out_sample_segments: the sample has neither group_id nor index to share")
    k = len(segments)
    if mode == "split":
        if isinstance(reward, dict):
            raise ValueError("--fan-out-reward split needs a scalar reward, got a dict")
        seg_reward: float | dict[str, Any] = float(reward) / k
    else:
        seg_reward = reward
    base_meta = dict(sample.metadata)
    out: list[Sample] = []
    for j, seg in enumerate(segments):
        s = sample if j == 0 else copy.copy(sample)
        n = len(seg.response_ids)
        mask = list(seg.loss_mask) if seg.loss_mask is not None else [1] * n
        if len(mask) != n:
            raise ValueError(f"segment {j}: loss_mask has {len(mask)} entries for {n} response tokens")
        s.group_id = group_id
        s.tokens = list(seg.prompt_ids) + list(seg.response_ids)
        s.response_length = n
        s.loss_mask = mask
        s.rollout_log_probs = list(seg.rollout_log_probs) if seg.rollout_log_probs is not None else None
        # per-token data of the original sequence no longer lines up with the segment's tokens
        s.teacher_log_probs = None
        s.rollout_routed_experts = None
        s.response = tokenizer.decode(seg.response_ids) if tokenizer is not None else s.response
        s.reward = copy.deepcopy(seg_reward)
        s.weight_versions = list(sample.weight_versions)
        s.spec_info = dict(sample.spec_info)
        s.prefix_cache_info = dict(sample.prefix_cache_info)
        s.metadata = {**base_meta, **dict(seg.metadata), **dict(metadata or {}), "segment_idx": j, "num_segments": k}
        if s.status == Status.PENDING:
            s.status = Status.COMPLETED
        out.append(s)
    return out
