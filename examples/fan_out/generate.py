"""A custom generate function whose trajectories fan out into 1–4 training samples (simulated compaction).

Use: ``slime train ... --custom-generate-function-path examples.fan_out.generate.generate``.

What it simulates: an agent whose context is compacted mid-trajectory. Each trajectory draws K in 1..4
(seeded by the trajectory's sampling seed, so a rerun draws the same K) and spends its response budget in K
engine calls. Call 1 sees the prompt; before each later call the context is "compacted" to the prompt plus
the last `KEEP_TAIL` tokens generated so far (a stand-in for a summary). Every call becomes one segment
(its exact context as the prompt, its sampled tokens as the response, the engine's log-probs), and
`fan_out_sample_segments` turns the K segments into K `Sample`s sharing the trajectory's `group_id`.

Why it matters for training: the number of samples per rollout varies, yet the optimizer step still counts
trajectories (groups). The loss normaliser treats a group as one long sample split into segments, and GRPO
normalises rewards over trajectories, not segments — so the metrics show `train/samples` changing from step
to step while `train/global_batch_size` (groups) stays constant.

The whole trajectory is scored once (its segments' responses joined) and every segment gets that reward
(`--fan-out-reward full`, or reward/K with `split`). A segment that ends on a stop token ends the trajectory
early (fewer segments). Partial rollout is not supported by this example: an aborted call aborts the
trajectory. Evaluation (`evaluation=True`) generates in one call, without compaction.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from typing import Any

from slime.agent.trajectory import TokenSegment, fan_out_sample_segments
from slime.rollout.dataset import load_tokenizer
from slime.rollout.generate import generate as default_generate
from slime.rollout.rm_hub import async_rm
from slime.utils.types import Sample, Status

logger = logging.getLogger(__name__)

MAX_SEGMENTS = 4
KEEP_TAIL = 3  # tokens of the previous segments the compacted context keeps


def num_segments(args: Any, sample: Sample) -> int:
    """K in 1..MAX_SEGMENTS, a pure function of the rollout seed and the trajectory's sampling seed."""
    key = sample.metadata.get("sampling_seed", sample.index)
    return random.Random(f"{getattr(args, 'rollout_seed', 42)}:{key}").randint(1, MAX_SEGMENTS)


def split_budget(budget: int, k: int) -> list[int]:
    """`budget` tokens over k calls, as evenly as possible, every call getting at least one token."""
    k = max(1, min(k, budget))
    return [budget // k + (1 if j < budget % k else 0) for j in range(k)]


async def _call(args: Any, context: list[int], params: dict[str, Any], seed: int | None) -> Sample:
    """One engine call continuing `context`, through slime's default `generate` (router, log-probs, status)."""
    seg = Sample(tokens=list(context), status=Status.PENDING)
    p = dict(params)
    if seed is not None:
        p["sampling_seed"] = seed
    return await default_generate(args, seg, p)


async def generate(
    args: Any, sample: Sample, sampling_params: dict[str, Any], evaluation: bool = False
) -> Sample | list[Sample]:
    if evaluation:
        return await default_generate(args, sample, sampling_params)
    budget = sampling_params.get("max_new_tokens") or args.rollout_max_response_len
    sizes = split_budget(int(budget), num_segments(args, sample))
    seed = sampling_params.get("sampling_seed")

    # segment 0 continues the sample itself, so prompt tokenisation and chat templates are slime's own
    first = await default_generate(args, sample, dict(sampling_params, max_new_tokens=sizes[0]))
    prompt_ids = first.tokens[: len(first.tokens) - first.response_length]
    segments = [_segment(prompt_ids, first, kind="pre_compaction" if len(sizes) > 1 else "final")]
    response_ids = list(first.tokens[len(prompt_ids) :])
    texts = [first.response]
    status = first.status
    for j, size in enumerate(sizes[1:], start=1):
        if status != Status.TRUNCATED:  # stopped (the trajectory is over) or aborted
            break
        context = prompt_ids + response_ids[-KEEP_TAIL:]
        part = await _call(args, context, dict(sampling_params, max_new_tokens=size), _next_seed(seed, j))
        kind = "final" if j == len(sizes) - 1 else "post_compaction"
        segments.append(_segment(context, part, kind=kind))
        response_ids += part.tokens[len(context) :]
        texts.append(part.response)
        sample.weight_versions += part.weight_versions
        status = part.status
    if status == Status.ABORTED:
        sample.status = Status.ABORTED
        return sample

    # score the whole trajectory once; every segment inherits it (one trajectory, one reward: docs/algorithms.md)
    full = dataclasses.replace(sample, response="".join(texts), status=status)
    reward = await async_rm(args, full)
    sample.status = status
    out = fan_out_sample_segments(
        sample,
        segments,
        reward,
        mode=getattr(args, "fan_out_reward", "full"),
        tokenizer=load_tokenizer(args.hf_checkpoint),
    )
    logger.debug("trajectory %s: %d segments, reward %s", sample.index, len(out), reward)
    return out


def _segment(context: list[int], s: Sample, kind: str) -> TokenSegment:
    n = s.response_length
    return TokenSegment(
        prompt_ids=list(context),
        response_ids=list(s.tokens[len(s.tokens) - n :]),
        rollout_log_probs=list(s.rollout_log_probs or [0.0] * n),
        metadata={"segment_kind": kind},
    )


def _next_seed(seed: int | None, j: int) -> int | None:
    return None if seed is None else (int(seed) * 1_000_003 + j) % (2**31 - 1)
