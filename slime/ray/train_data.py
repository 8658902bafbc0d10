"""Rollout samples -> per-DP-rank train data, on the RolloutManager.

Order matters: samples are converted to per-sample lists (rewards normalised per prompt over *this* rollout's
trajectories; `--custom-convert-samples-to-train-data-path` replaces this step), then the carry buffer
prepends groups left over from the previous rollout (their values stay frozen), then the step / micro-batch /
DP schedule is built and each rank receives exactly its samples plus the per-step denominators.

The train-data dict (what a train rank receives; `docs/architecture.md` shows it): per-sample lists
`tokens`, `response_lengths`, `total_lengths`, `loss_masks`, `group_mask_sums`, `rewards`, `raw_reward`,
`truncated`, `sample_indices`, `group_ids`, `origin_rollout_ids`, `batch_positions` (index in the rollout's
train batch) and `next_segments` (the batch position of the same group's next segment, -1 if none), optional
`rollout_log_probs`, `teacher_log_probs` (OPD from --sglang-config), `ref_log_probs` (--ref-model-name) and
`metadata` (plus any other per-sample list a custom conversion adds), and the schedule: `micro_batch_indices` (this
rank's micro-batches as indices into the lists), `num_microbatches` and `global_batch_sizes` per step.
"""

from __future__ import annotations

import logging
from argparse import Namespace
from typing import Any

from slime.algorithms.fan_out import assign_default_group_ids, flatten_samples, validate_fan_out
from slime.scheduling.carry import CarryBuffer, TrainBatch
from slime.scheduling.denominators import group_mask_sums, sample_loss_mask
from slime.scheduling.schedule import Schedule, build_schedule_from_args
from slime.utils.errors import SlimeArgError
from slime.utils.misc import load_function
from slime.utils.types import Sample, Status

logger = logging.getLogger(__name__)

REQUIRED_KEYS = ("tokens", "response_lengths", "loss_masks", "rewards")


def rollout_samples(output: list[Any]) -> list[Sample]:
    """A rollout function's output (prompt x trajectory, deeper with fan-out) as a flat list, with every
    trajectory's group id set."""
    validate_fan_out(output)
    samples = flatten_samples(output)
    assign_default_group_ids(samples)
    return samples


def post_process_rewards(args: Namespace, samples: list[Sample]) -> tuple[list[float], list[float]]:
    """(raw, normalised) per sample. GRPO statistics are over trajectories grouped by prompt index."""
    if args.custom_reward_post_process_path:
        return load_function(args.custom_reward_post_process_path)(args, samples)
    # here, not at module level: the driver imports this module (through RolloutManager) and never needs torch
    from slime.algorithms.advantages import normalize_rewards_from_args

    raw = [s.get_reward_value(args) for s in samples]
    return raw, [float(r) for r in normalize_rewards_from_args(args, samples)]


def samples_to_train_data(args: Namespace, samples: list[Sample]) -> dict[str, list[Any]]:
    """The default conversion: per-sample lists with slime's keys. `Sample.remove_sample` zeroes the sample's
    loss mask (it still counts in the reward normalisation)."""
    raw, rewards = post_process_rewards(args, samples)
    data: dict[str, list[Any]] = {
        "tokens": [s.tokens for s in samples],
        "response_lengths": [s.response_length for s in samples],
        "loss_masks": [[0] * s.response_length if s.remove_sample else sample_loss_mask(s) for s in samples],
        "rewards": rewards,
        "raw_reward": raw,
        "truncated": [int(s.status == Status.TRUNCATED) for s in samples],
        "sample_indices": [s.index for s in samples],
    }
    if samples and all(s.rollout_log_probs is not None for s in samples):
        data["rollout_log_probs"] = [s.rollout_log_probs for s in samples]
    # scored on the rollout side by other models of --sglang-config (slime/rollout/model_scoring.py)
    for key, wanted in (
        ("teacher_log_probs", args.use_opd and args.opd_type == "sglang"),
        ("ref_log_probs", args.ref_model_name is not None),
    ):
        if wanted:
            data[key] = [_scored(s, key) for s in samples]
    if any(s.train_metadata for s in samples):
        data["metadata"] = [s.train_metadata for s in samples]
    return data


def _scored(sample: Sample, key: str) -> list[float]:
    values = getattr(sample, key)
    if values is None or len(values) != sample.response_length:
        got = "none" if values is None else f"{len(values)} values"
        raise ValueError(f"sample {sample.index}: {key} has {got} for {sample.response_length} response tokens")
    return list(values)


def convert_samples(args: Namespace, samples: list[Sample]) -> dict[str, list[Any]]:
    """`samples_to_train_data`, or `--custom-convert-samples-to-train-data-path(args, samples) -> dict`.

    Per-sample lists are kept (and carried over with their group); other values are dropped with a warning,
    since the schedule, not the conversion, decides what each rank trains."""
    if not args.custom_convert_samples_to_train_data_path:
        return samples_to_train_data(args, samples)
    hook = args.custom_convert_samples_to_train_data_path
    out = load_function(hook)(args, samples)
    if not isinstance(out, dict):
        raise SlimeArgError(f"--custom-convert-samples-to-train-data-path {hook}: returned {type(out).__name__}")
    data: dict[str, list[Any]] = {}
    for key, value in out.items():
        if isinstance(value, list | tuple) and len(value) == len(samples):
            data[key] = list(value)
        else:
            logger.warning("custom train data: %r is not a per-sample list; dropped", key)
    missing = [k for k in REQUIRED_KEYS if k not in data]
    if missing:
        raise SlimeArgError(
            f"--custom-convert-samples-to-train-data-path {hook}: no per-sample list for {', '.join(missing)}"
        )
    columns = zip(data["tokens"], data["response_lengths"], data["loss_masks"], strict=True)
    for i, (tokens, n, mask) in enumerate(columns):
        if len(mask) != n or n > len(tokens):
            raise SlimeArgError(
                f"--custom-convert-samples-to-train-data-path {hook}: sample {i} has {len(tokens)} tokens, "
                f"response length {n} and a loss mask of {len(mask)}"
            )
    return data


def _rank_data(batch: TrainBatch, schedule: Schedule, rank: int) -> dict[str, Any]:
    idx = schedule.partitions[rank]
    values = batch.values
    group_ids = [s.train_group_id for s in batch.samples]
    # Denominators per step over the whole step's group (all ranks), so partial sums add up exactly.
    denoms = [0] * len(batch.samples)
    for step in schedule.steps:
        step_idx = step.sample_indices
        sums = group_mask_sums([values["loss_masks"][i] for i in step_idx], [group_ids[i] for i in step_idx])
        for i, d in zip(step_idx, sums, strict=True):
            denoms[i] = d
    # A fan-out group's next segment in batch order: PPO's GAE chains segments as one long sample (algorithms/ppo.py).
    next_segment = [-1] * len(batch.samples)
    last_of: dict[int, int] = {}
    for i, g in enumerate(group_ids):
        if g in last_of:
            next_segment[last_of[g]] = i
        last_of[g] = i
    data: dict[str, Any] = {key: [column[i] for i in idx] for key, column in values.items()}
    data.update(
        total_lengths=[len(values["tokens"][i]) for i in idx],
        batch_positions=list(idx),
        next_segments=[next_segment[i] for i in idx],
        group_mask_sums=[denoms[i] for i in idx],
        group_ids=[group_ids[i] for i in idx],
        origin_rollout_ids=[batch.origin_rollout_ids[i] for i in idx],
        micro_batch_indices=schedule.micro_batch_indices[rank],
        num_microbatches=schedule.num_microbatches,
        global_batch_sizes=schedule.global_batch_sizes,
    )
    return data


def build_rank_data(
    args: Namespace, rollout_id: int, samples: list[Sample], carry: CarryBuffer, parallel_config: dict[str, int]
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """One train-data dict per DP rank, plus scheduling metrics (carried/deferred groups, steps)."""
    batch = carry.merge(rollout_id, samples, convert_samples(args, samples))
    lengths = [len(t) for t in batch.values["tokens"]]
    schedule = build_schedule_from_args(args, batch.samples, parallel_config, total_lengths=lengths)
    metrics = carry.defer(batch, schedule.leftover_sample_indices)
    metrics["train/num_steps"] = float(len(schedule.steps))
    metrics["train/num_samples"] = float(len(schedule.scheduled_sample_indices))
    return [_rank_data(batch, schedule, r) for r in range(schedule.dp_size)], metrics
