"""Turning one agent trajectory into training samples.

`merge_turns` folds the engine calls of one conversation chain (`TurnRecord`s: the exact prompt ids sent,
the sampled ids and log-probs) into token segments by exact token-prefix matching: sampled
tokens are trained (mask 1), everything the client or the template added in between (tool results, user
turns, template glue) is context (mask 0). When a later prompt no longer reproduces an earlier output
token for token (re-tokenisation drift), that output span is masked out: a target the model did not sample
in exactly this context would teach it the wrong thing.

`fan_out_sample_segments` then emits one `Sample` per segment (sub-agent calls, pre/post context compaction)
while keeping them one training group. The loss normaliser treats the group as one long sample split into
segments (`slime/scheduling/denominators.py`), and GRPO statistics count the trajectory once
(`slime/algorithms/advantages.py`).
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


@dataclass(frozen=True)
class TurnRecord:
    """One engine call: the full prompt ids sent, the sampled ids and their log-probs (aligned, may be None)."""

    prompt_ids: list[int]
    output_ids: list[int]
    output_log_probs: list[float] | None = None
    finish_reason: str = "stop"


class _Builder:
    """One segment under construction; `spans` are the [start, end) response ranges sampled by the model."""

    def __init__(self, turn: TurnRecord) -> None:
        self.prompt = list(turn.prompt_ids)
        self.resp: list[int] = []
        self.mask: list[int] = []
        self.lps: list[float] = []
        self.spans: list[tuple[int, int]] = []
        self.num_turns = 0
        self.num_drifts = 0
        self.finish_reason = turn.finish_reason
        self.add_output(turn)

    def add_output(self, turn: TurnRecord) -> None:
        lps = turn.output_log_probs
        if lps is None or len(lps) != len(turn.output_ids):
            if lps is not None:
                logger.warning(
                    "turn has %d log-probs for %d output ids; its log-probs are zeroed",
                    len(lps),
                    len(turn.output_ids),
                )
            lps = [0.0] * len(turn.output_ids)
        start = len(self.resp)
        self.resp += list(turn.output_ids)
        self.mask += [1] * len(turn.output_ids)
        self.lps += [float(x) for x in lps]
        if turn.output_ids:
            self.spans.append((start, len(self.resp)))
        self.num_turns += 1
        self.finish_reason = turn.finish_reason

    def extend(self, turn: TurnRecord) -> None:
        suffix = turn.prompt_ids[len(self.prompt) :]
        n = 0
        limit = min(len(self.resp), len(suffix))
        while n < limit and self.resp[n] == suffix[n]:
            n += 1
        if n < len(self.resp):
            # Drift: the re-rendered history diverges at response position n. Everything after is replaced by
            # the new rendering; a sampled span cut at n keeps its head as context only.
            self.num_drifts += 1
            for start, end in self.spans:
                if start < n < end:
                    for i in range(start, n):
                        self.mask[i], self.lps[i] = 0, 0.0
            self.spans = [(a, min(b, n)) for a, b in self.spans if a < n and not (a < n < b)]
            del self.resp[n:], self.mask[n:], self.lps[n:]
        tail = suffix[n:]
        self.resp += tail
        self.mask += [0] * len(tail)
        self.lps += [0.0] * len(tail)
        self.add_output(turn)

    def build(self, kind: str, metadata: Mapping[str, Any] | None) -> TokenSegment:
        meta = {
            **dict(metadata or {}),
            "segment_kind": kind,
            "num_turns": self.num_turns,
            "num_drifts": self.num_drifts,
            "finish_reason": self.finish_reason,
        }
        return TokenSegment(list(self.prompt), list(self.resp), list(self.mask), list(self.lps), meta)


def merge_turns(
    turns: Sequence[TurnRecord], *, kind: str = "final", metadata: Mapping[str, Any] | None = None
) -> list[TokenSegment]:
    """Merge the turns of one chain into segments (usually one).

    A turn whose prompt does not start with the segment's prompt (the client rewrote the start of the
    history) starts a new segment instead of discarding what was sampled so far (v0.3.0 dropped it).
    """
    out: list[TokenSegment] = []
    cur: _Builder | None = None
    for turn in turns:
        if cur is not None and turn.prompt_ids[: len(cur.prompt)] == cur.prompt:
            cur.extend(turn)
            continue
        if cur is not None:
            logger.warning("turn prompt does not extend the segment prompt; starting a new segment")
            out.append(cur.build(kind, metadata))
        cur = _Builder(turn)
    if cur is not None:
        out.append(cur.build(kind, metadata))
    return out


def segment_to_json(seg: TokenSegment) -> dict[str, Any]:
    """The admin API's wire form of a segment (what `/admin/sessions/{id}/finish` returns)."""
    return {
        "tokens": list(seg.prompt_ids) + list(seg.response_ids),
        "prompt_length": len(seg.prompt_ids),
        "response_length": len(seg.response_ids),
        "loss_mask": list(seg.loss_mask) if seg.loss_mask is not None else [1] * len(seg.response_ids),
        "rollout_log_probs": list(seg.rollout_log_probs) if seg.rollout_log_probs is not None else None,
        "metadata": dict(seg.metadata),
    }


def segment_from_json(d: Mapping[str, Any]) -> TokenSegment:
    n = int(d["prompt_length"])
    tokens = list(d["tokens"])
    return TokenSegment(
        tokens[:n], tokens[n:], d.get("loss_mask"), d.get("rollout_log_probs"), d.get("metadata") or {}
    )


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
