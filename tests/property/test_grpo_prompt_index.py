"""GRPO / REINFORCE++-baseline normalisation by prompt index with uneven fan-out, against a token loop.

The reference walks every response token, finds its trajectory and prompt, and computes the prompt's
statistics over *trajectories* with plain Python — the definition the vectorised code must match.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from slime.algorithms.advantages import (
    expand_to_tokens,
    normalize_rewards_by_prompt,
    normalize_rewards_from_args,
    reinforce_plus_plus_baseline_rewards,
)
from slime.utils.types import Sample
from tests.hypothesis_budget import examples

pytestmark = pytest.mark.cpu

RTOL = 1e-12


@st.composite
def fan_out_batch(draw):
    """Samples of several prompts: uneven trajectory counts, uneven segment counts, shuffled order."""
    samples = []  # (group_index, group_id, segment reward, response_length)
    traj_reward = {}
    gid = 0
    split = draw(st.booleans())
    for prompt in draw(st.lists(st.integers(0, 10**4), min_size=1, max_size=5, unique=True)):
        for _ in range(draw(st.integers(1, 5))):
            # dyadic rewards (and, when split, power-of-two K) keep sums and shares exact, so equal rewards
            # give exactly zero spread: near-zero std would amplify rounding by 1/eps in any implementation.
            # Small integers make ties and zero-std prompts common.
            r = draw(st.one_of(st.integers(-2, 2), st.integers(-80, 80))) / 8
            traj_reward[gid] = r
            k = draw(st.sampled_from([1, 2, 4]) if split else st.integers(1, 4))
            for _ in range(k):
                samples.append((prompt, gid, r / k if split else r, draw(st.integers(0, 6))))
            gid += 1
    samples = draw(st.permutations(samples))
    return samples, traj_reward, split


def _reference_tokens(samples, traj_reward, std_norm, eps=1e-6):
    out = []
    for prompt, gid, _, n in samples:
        row = []
        for _ in range(n):  # per token, recompute everything from the trajectories of this prompt
            rs = [traj_reward[g] for g in sorted({g for p, g, _, _ in samples if p == prompt})]
            mean = sum(rs) / len(rs)
            value = traj_reward[gid] - mean
            if std_norm:
                std = math.sqrt(sum((r - mean) ** 2 for r in rs) / (len(rs) - 1)) if len(rs) > 1 else 0.0
                value = value / (std + eps)
            row.append(value)
        out.append(torch.tensor(row, dtype=torch.float64))
    return out


@settings(max_examples=examples(250), deadline=None)
@given(fan_out_batch(), st.booleans())
def test_grpo_by_prompt_index_matches_token_loop(batch, std_norm):
    samples, traj_reward, split = batch
    rewards = [r for _, _, r, _ in samples]
    prompts = [p for p, _, _, _ in samples]
    gids = [g for _, g, _, _ in samples]
    mode = "split" if split else "full"
    if std_norm:
        norm = normalize_rewards_by_prompt(rewards, prompts, gids, std_normalization=True, segment_reward=mode)
    else:
        norm = reinforce_plus_plus_baseline_rewards(rewards, prompts, gids, segment_reward=mode)
    tokens = expand_to_tokens(norm, [n for *_, n in samples], dtype=torch.float64)
    # a trajectory's reward as its segments carry it: whole (full) or the sum of its K shares (split)
    seg_total = {}
    for _, g, r, _ in samples:
        seg_total[g] = seg_total.get(g, 0.0) + r
    traj = traj_reward if not split else seg_total
    assert all(math.isclose(traj[g], traj_reward[g], rel_tol=1e-12, abs_tol=1e-12) for g in traj_reward)
    ref = _reference_tokens(samples, traj, std_norm)
    for got, want in zip(tokens, ref, strict=True):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=1e-12)
    # every segment inherits its trajectory's value
    by_gid = {}
    for g, v in zip(gids, norm, strict=True):
        assert by_gid.setdefault(g, v) == v


def test_uneven_fan_out_does_not_weigh_segments():
    # prompt 0: trajectory A (reward 1) fans out into 3 segments, B (reward 0) is one sample
    rewards, prompts, gids = [1.0, 1.0, 1.0, 0.0], [0, 0, 0, 0], [10, 10, 10, 11]
    norm = reinforce_plus_plus_baseline_rewards(rewards, prompts, gids)
    assert norm == [0.5, 0.5, 0.5, -0.5]  # mean over trajectories is 0.5, not 0.75 over samples


def test_from_args_reads_estimator_flags(make_args: Callable[..., Any]):
    samples = [
        Sample(group_index=0, index=0, reward=1.0),
        Sample(group_index=0, index=1, group_id=1, reward=1.0),
        Sample(group_index=0, index=1, group_id=1, reward=1.0),
        Sample(group_index=0, index=2, reward=0.0),
        Sample(group_index=1, index=3, reward=5.0),
    ]
    args = make_args(advantage_estimator="grpo", n_samples_per_prompt=2, fan_out_reward="full")
    out = normalize_rewards_from_args(args, samples)
    s = math.sqrt(((1 - 2 / 3) ** 2 * 2 + (2 / 3) ** 2) / 2)
    assert out[:4] == pytest.approx([(1 / 3) / (s + 1e-6)] * 3 + [(-2 / 3) / (s + 1e-6)], rel=RTOL)
    assert out[4] == 0.0  # a prompt with a single trajectory has no spread
    args.disable_rewards_normalization = True
    assert normalize_rewards_from_args(args, samples) == [1.0, 1.0, 1.0, 0.0, 5.0]
    args = make_args(advantage_estimator="reinforce_plus_plus")
    assert normalize_rewards_from_args(args, samples) == [1.0, 1.0, 1.0, 0.0, 5.0]
    # PPO: a fan-out trajectory is one long sample for GAE, its reward on its last segment only
    args = make_args(advantage_estimator="ppo")
    assert normalize_rewards_from_args(args, samples) == [1.0, 0.0, 1.0, 0.0, 5.0]
