"""The reward hub: turn a finished `Sample` into its reward.

Selection order (as in slime): `--custom-rm-path` wins; else the sample's `metadata["rm_type"]` (so one
dataset can mix graders) else `--rm-type`. A `boxed_` prefix grades only the last `\\boxed{}` answer, so
chain-of-thought text before it cannot match by accident.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import logging
import random
from collections.abc import Callable
from typing import Any

from slime.rollout.rm_hub.boxed import last_boxed_answer
from slime.rollout.rm_hub.f1 import f1_score
from slime.rollout.rm_hub.math_grader import grade_math
from slime.rollout.rm_hub.remote import close_remote_session, remote_rm
from slime.rollout.rm_hub.reward_model import reward_model_chat_rewards, reward_model_rewards
from slime.utils.errors import SlimeArgError
from slime.utils.misc import load_function
from slime.utils.types import Sample

logger = logging.getLogger(__name__)

Reward = float | dict[str, Any]

__all__ = [
    "KNOWN_RM_TYPES",
    "async_rm",
    "batched_async_rm",
    "close_remote_session",
    "f1_score",
    "grade_math",
    "last_boxed_answer",
]


def _random_rm(args: Any, sample: Sample, response: str) -> float:
    # Seeded by (rollout seed, sample index): a baseline/smoke-test reward that replays identically.
    rng = random.Random(f"{args.rollout_seed}:{sample.index if sample.index is not None else 0}")
    return float(rng.random() < 0.5)


# name -> fn(args, sample, response_text); `remote_rm` is async and sends the raw sample instead.
_LOCAL_RMS: dict[str, Callable[[Any, Sample, str], float]] = {
    "math": lambda args, sample, response: grade_math(response, sample.label),
    "f1": lambda args, sample, response: f1_score(response, sample.label),
    "random": _random_rm,
}
# asked of a reward model of --sglang-config (--rm-model-name): a list of samples in, one reward each out
_MODEL_RMS = {"reward_model": reward_model_rewards, "reward_model_chat": reward_model_chat_rewards}
KNOWN_RM_TYPES: tuple[str, ...] = (*_LOCAL_RMS, "remote_rm", *_MODEL_RMS)


@functools.lru_cache(maxsize=32)
def _load_custom_rm(path: str) -> Callable[..., Any]:
    return load_function(path)


async def _call_maybe_async(fn: Callable[..., Any], *fn_args: Any) -> Any:
    out = fn(*fn_args)
    return await out if inspect.isawaitable(out) else out


async def async_rm(args: Any, sample: Sample) -> Reward:
    """The reward of one sample: a float, or a dict when the grader reports several fields."""
    custom = args.custom_rm_path
    if custom:
        return await _call_maybe_async(_load_custom_rm(custom), args, sample)

    rm_type = (sample.metadata or {}).get("rm_type") or args.rm_type
    if not rm_type:
        raise SlimeArgError(
            f"no reward function for sample {sample.index}: set --rm-type (one of {', '.join(KNOWN_RM_TYPES)}), "
            "a per-sample metadata['rm_type'], or --custom-rm-path"
        )
    response = sample.response
    base = rm_type
    if rm_type.startswith("boxed_"):
        base = rm_type[len("boxed_") :]
        response = last_boxed_answer(response) or ""
    if base in ("remote_rm", *_MODEL_RMS):
        if base != rm_type:
            sample = dataclasses.replace(sample, response=response)
        if base == "remote_rm":
            return await remote_rm(args, sample)
        return (await _MODEL_RMS[base](args, [sample]))[0]
    fn = _LOCAL_RMS.get(base)
    if fn is None:
        raise SlimeArgError(
            f"unknown rm_type {rm_type!r}: known types are {', '.join(KNOWN_RM_TYPES)} (each also with a "
            "'boxed_' prefix); for anything else pass --custom-rm-path module.fn"
        )
    if rm_type.startswith("boxed_") and not response:
        return 0.0  # no boxed answer at all: nothing to grade
    return fn(args, sample, response)


async def batched_async_rm(args: Any, samples: list[Sample]) -> list[Reward]:
    """Rewards for a list of samples; with `--group-rm` the custom fn sees the whole list (pairwise/group RMs)."""
    custom = args.custom_rm_path
    if args.group_rm and custom:
        rewards = await _call_maybe_async(_load_custom_rm(custom), args, samples)
        if not isinstance(rewards, (list, tuple)) or len(rewards) != len(samples):
            got = len(rewards) if isinstance(rewards, (list, tuple)) else type(rewards).__name__
            raise ValueError(f"group rm {custom!r} returned {got} rewards for {len(samples)} samples")
        return list(rewards)
    types = {(s.metadata or {}).get("rm_type") or args.rm_type for s in samples}
    if not custom and len(types) == 1 and (rm_type := types.pop()) in _MODEL_RMS:
        return list(await _MODEL_RMS[rm_type](args, samples))  # one batched call for the whole list
    return list(await asyncio.gather(*(async_rm(args, s) for s in samples)))
