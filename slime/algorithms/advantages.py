"""Reward normalisation for GRPO / GSPO / REINFORCE++-baseline, by prompt index, over trajectories.

slime reshapes the flat reward list into (-1, n_samples_per_prompt) blocks and, when fan-out changes the
length, silently treats the whole batch as one group (spec §5.4). Here statistics are always keyed by the
prompt index `group_index`, and each trajectory (`group_id`) counts once however many segments it fanned
out into: a trajectory split in K segments must not weigh K times in its prompt's mean and std. Every
segment then inherits its trajectory's normalised reward, which is its advantage for GRPO/GSPO.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

logger = logging.getLogger(__name__)

_NORMALISED_ESTIMATORS = ("grpo", "gspo", "reinforce_plus_plus_baseline")


def trajectory_rewards(
    rewards: Sequence[float], group_ids: Sequence[int], *, segment_reward: str = "full"
) -> dict[int, float]:
    """One reward per trajectory: segments carry it whole (`full`: their mean) or in K shares (`split`: sum)."""
    if segment_reward not in ("full", "split"):
        raise ValueError(f"segment_reward must be 'full' or 'split', got {segment_reward!r}")
    total: dict[int, float] = {}
    count: dict[int, int] = {}
    for r, g in zip(rewards, group_ids, strict=True):
        total[g] = total.get(g, 0.0) + float(r)
        count[g] = count.get(g, 0) + 1
    if segment_reward == "split":
        return total
    return {g: total[g] / count[g] for g in total}


def normalize_rewards_by_prompt(
    rewards: Sequence[float],
    group_indices: Sequence[int],
    group_ids: Sequence[int],
    *,
    std_normalization: bool = True,
    eps: float = 1e-6,
    segment_reward: str = "full",
) -> list[float]:
    """Per-sample (R_traj - mean_prompt) [/ (std_prompt + eps)], statistics over the prompt's trajectories.

    std is torch's unbiased estimator, as in slime; a prompt with a single trajectory has no spread and gets
    std 0 (so its advantage is 0) instead of NaN. Returns float64 values as a list aligned with `rewards`.
    """
    n = len(rewards)
    if not (len(group_indices) == len(group_ids) == n):
        raise ValueError(f"{n} rewards, {len(group_indices)} group_indices, {len(group_ids)} group_ids")
    if n == 0:
        return []
    traj_reward = trajectory_rewards(rewards, group_ids, segment_reward=segment_reward)
    traj_prompt: dict[int, int] = {}
    for g, p in zip(group_ids, group_indices, strict=True):
        if traj_prompt.setdefault(g, p) != p:
            raise ValueError(f"trajectory {g} has segments with different prompt indices ({traj_prompt[g]} and {p})")
    trajs = list(traj_reward)
    prompts = sorted(set(traj_prompt.values()))
    prompt_pos = {p: j for j, p in enumerate(prompts)}
    r = torch.tensor([traj_reward[g] for g in trajs], dtype=torch.float64)
    pid = torch.tensor([prompt_pos[traj_prompt[g]] for g in trajs], dtype=torch.long)
    k = len(prompts)
    cnt = torch.zeros(k, dtype=torch.float64).index_add_(0, pid, torch.ones_like(r))
    mean = torch.zeros(k, dtype=torch.float64).index_add_(0, pid, r) / cnt
    centred = r - mean[pid]
    if std_normalization:
        ss = torch.zeros(k, dtype=torch.float64).index_add_(0, pid, centred * centred)
        std = torch.where(cnt > 1, (ss / (cnt - 1).clamp(min=1)).sqrt(), torch.zeros_like(ss))
        centred = centred / (std[pid] + eps)
    by_traj = dict(zip(trajs, centred.tolist(), strict=True))
    return [by_traj[g] for g in group_ids]


def reinforce_plus_plus_baseline_rewards(
    rewards: Sequence[float], group_indices: Sequence[int], group_ids: Sequence[int], *, segment_reward: str = "full"
) -> list[float]:
    """REINFORCE++-baseline: subtract the prompt's mean trajectory reward (no std division)."""
    return normalize_rewards_by_prompt(
        rewards, group_indices, group_ids, std_normalization=False, segment_reward=segment_reward
    )


def normalize_rewards_from_args(args: Any, samples: Sequence[Any]) -> list[float]:
    """The rollout-side reward post-processing of slime, keyed by prompt index (`Sample.group_index`)."""
    raw = [s.get_reward_value(args) for s in samples]
    if getattr(args, "advantage_estimator", "grpo") not in _NORMALISED_ESTIMATORS or getattr(
        args, "disable_rewards_normalization", False
    ):
        return raw
    std = (
        args.advantage_estimator in ("grpo", "gspo")
        and not getattr(args, "disable_grpo_std_normalization", False)
        and getattr(args, "n_samples_per_prompt", 1) > 1
    )
    group_ids = [s.group_id if s.group_id is not None else s.index for s in samples]
    return normalize_rewards_by_prompt(
        raw,
        [s.group_index for s in samples],
        group_ids,
        std_normalization=std,
        segment_reward=getattr(args, "fan_out_reward", "full"),
    )


def expand_to_tokens(
    values: Sequence[float], response_lengths: Sequence[int], *, dtype: torch.dtype = torch.float32
) -> list[torch.Tensor]:
    """GRPO/GSPO advantages: each sample's normalised reward on every one of its response tokens."""
    return [torch.full((n,), float(v), dtype=dtype) for v, n in zip(values, response_lengths, strict=True)]
