"""Built-in dynamic-sampling filters (DAPO): drop prompt groups that carry no learning signal."""

from __future__ import annotations

import math
from typing import Any

from slime.rollout.filter_hub.base_types import DynamicFilterOutput
from slime.utils.types import Sample


def _flatten(group: list[Sample | list[Sample]]) -> list[Sample]:
    return [s for item in group for s in (item if isinstance(item, list) else [item])]


def check_reward_nonzero_std(args: Any, samples: list[Sample | list[Sample]], **kwargs: Any) -> DynamicFilterOutput:
    """Keep a group only if its rewards differ: with identical rewards every GRPO advantage is zero, so the
    group would cost a training step and teach nothing. Fan-out groups are judged on all their segments."""
    rewards = [s.get_reward_value(args) for s in _flatten(samples)]
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
    if std > 1e-6:
        return DynamicFilterOutput(keep=True)
    return DynamicFilterOutput(keep=False, reason=f"zero_std_{round(rewards[0], 1)}")
