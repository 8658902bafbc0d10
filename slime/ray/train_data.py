"""Rollout samples → per-DP-rank train data (spec §1.7), on the RolloutManager.

Order matters: rewards are normalised per prompt over *this* rollout's trajectories, then the carry buffer
prepends groups left over from the previous rollout (their rewards stay frozen), then the step / micro-batch /
DP schedule is built and each rank receives exactly its samples plus the per-step denominators.
"""

from __future__ import annotations

import logging
from argparse import Namespace
from typing import Any

from slime.algorithms.advantages import normalize_rewards_from_args
from slime.algorithms.fan_out import validate_fan_out
from slime.scheduling.carry import CarryBuffer, TrainBatch
from slime.scheduling.denominators import group_mask_sums, sample_loss_mask
from slime.scheduling.schedule import Schedule, build_schedule_from_args, sample_group_id
from slime.utils.misc import load_function
from slime.utils.types import Sample, Status

logger = logging.getLogger(__name__)


def flatten_samples(output: list[Any]) -> list[Sample]:
    """`list[list[Sample]]` (prompt × trajectory), or deeper with fan-out, to a flat list; ids defaulted."""
    validate_fan_out(output)
    flat: list[Sample] = []

    def walk(x: Any) -> None:
        if isinstance(x, Sample):
            flat.append(x)
        else:
            for y in x:
                walk(y)

    walk(output)
    for s in flat:
        if s.group_id is None:
            s.group_id = s.index
    return flat


def post_process_rewards(args: Namespace, samples: list[Sample]) -> tuple[list[float], list[float]]:
    """(raw, normalised) per sample. GRPO statistics are over trajectories grouped by prompt index."""
    if args.custom_reward_post_process_path:
        return load_function(args.custom_reward_post_process_path)(args, samples)
    raw = [s.get_reward_value(args) for s in samples]
    return raw, [float(r) for r in normalize_rewards_from_args(args, samples)]


def sample_values(args: Namespace, samples: list[Sample]) -> dict[str, list[Any]]:
    """Per-sample values frozen at rollout time (they travel with a group if it is carried over)."""
    raw, rewards = post_process_rewards(args, samples)
    return {"rewards": rewards, "raw_reward": raw}


def _rank_data(batch: TrainBatch, schedule: Schedule, rank: int) -> dict[str, Any]:
    idx = schedule.partitions[rank]
    samples = [batch.samples[i] for i in idx]
    masks = [[0] * s.response_length if s.remove_sample else sample_loss_mask(s) for s in batch.samples]
    # Denominators per step over the whole step's group (all ranks), so partial sums add up exactly.
    denoms = [0] * len(batch.samples)
    for step in schedule.steps:
        step_idx = step.sample_indices
        sums = group_mask_sums([masks[i] for i in step_idx], [sample_group_id(batch.samples[i]) for i in step_idx])
        for i, d in zip(step_idx, sums, strict=True):
            denoms[i] = d
    data: dict[str, Any] = {
        "tokens": [s.tokens for s in samples],
        "response_lengths": [s.response_length for s in samples],
        "total_lengths": [len(s.tokens) for s in samples],
        "loss_masks": [masks[i] for i in idx],
        "group_mask_sums": [denoms[i] for i in idx],
        "rewards": [batch.values["rewards"][i] for i in idx],
        "raw_reward": [batch.values["raw_reward"][i] for i in idx],
        "truncated": [int(s.status == Status.TRUNCATED) for s in samples],
        "sample_indices": [s.index for s in samples],
        "group_ids": [sample_group_id(s) for s in samples],
        "origin_rollout_ids": [batch.origin_rollout_ids[i] for i in idx],
        "micro_batch_indices": schedule.micro_batch_indices[rank],
        "num_microbatches": schedule.num_microbatches,
        "global_batch_sizes": schedule.global_batch_sizes,
    }
    if all(s.rollout_log_probs is not None for s in samples):
        data["rollout_log_probs"] = [s.rollout_log_probs for s in samples]
    if any(s.train_metadata for s in samples):
        data["metadata"] = [s.train_metadata for s in samples]
    return data


def build_rank_data(
    args: Namespace, rollout_id: int, samples: list[Sample], carry: CarryBuffer, parallel_config: dict[str, int]
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """One train-data dict per DP rank, plus scheduling metrics (carried/deferred groups, steps)."""
    batch = carry.merge(rollout_id, samples, sample_values(args, samples))
    schedule = build_schedule_from_args(args, batch.samples, parallel_config)
    metrics = carry.defer(batch, schedule.leftover_sample_indices)
    metrics["train/num_steps"] = float(len(schedule.steps))
    metrics["train/num_samples"] = float(len(schedule.scheduled_sample_indices))
    return [_rank_data(batch, schedule, r) for r in range(schedule.dp_size)], metrics
