"""What a rollout function (`--rollout-function-path`) returns, and the shim that tolerates legacy returns."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from slime.utils.types import Sample


@dataclass
class RolloutFnTrainOutput:
    # list[list[Sample]]: prompt group x trajectory; a trajectory may itself be a list[Sample] (fan-out:
    # segments sharing one group_id, slime/algorithms/fan_out.py).
    samples: list[list[Sample | list[Sample]]]
    metrics: dict[str, Any] | None = None


@dataclass
class RolloutFnEvalOutput:
    # {dataset_name: {"rewards": [...], "truncated": [...], "samples": [...]}}
    data: dict[str, dict[str, list[Any]]]
    metrics: dict[str, Any] | None = None


def call_rollout_fn(
    fn: Callable[..., Any], args: Any, rollout_id: int, data_source: Any, evaluation: bool
) -> RolloutFnTrainOutput | RolloutFnEvalOutput:
    """Call a rollout function and wrap a bare list (train) or dict (eval), as older slime plugins return."""
    out = fn(args, rollout_id, data_source, evaluation=evaluation)
    if evaluation:
        if isinstance(out, RolloutFnEvalOutput):
            return out
        if not isinstance(out, dict):
            raise TypeError(
                f"eval rollout function returned {type(out).__name__}; expected RolloutFnEvalOutput or dict"
            )
        return RolloutFnEvalOutput(data=out)
    if isinstance(out, RolloutFnTrainOutput):
        return out
    if not isinstance(out, list):
        raise TypeError(f"rollout function returned {type(out).__name__}; expected RolloutFnTrainOutput or list")
    return RolloutFnTrainOutput(samples=out)
