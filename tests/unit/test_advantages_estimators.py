"""Advantage estimators (grpo, gspo, reinforce++, reinforce++-baseline) and whitening, against hand numbers.

CP and DP layouts run on `SimulatedWorld`; the references are computed on whole responses with Python loops.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import pytest
import torch

from sim.fake_megatron import SimulatedWorld
from slime.algorithms.advantages import (
    compute_advantages_and_returns,
    normalize_rewards_by_prompt,
    normalize_rewards_from_args,
)
from slime.algorithms.cp_slicing import slice_response_for_cp
from slime.arguments import default_args
from slime.utils.types import Sample

pytestmark = pytest.mark.cpu

F64 = torch.float64


def _args(**kw: Any) -> argparse.Namespace:
    """The parser's defaults (GRPO, no KL, gamma 1, full fan-out reward) with 3 samples per prompt."""
    return default_args(**{"n_samples_per_prompt": 3, **kw})


def _uneven_samples() -> list[Sample]:
    # prompt 0: trajectories 10 (fanned out into 2 segments, reward 1), 11 and 12 (reward 0);
    # prompt 1: trajectories 20, 21 (rewards 2, 4); prompt 2: a single trajectory 30 (reward 5).
    spec = [
        (0, 10, 1.0, 3),
        (0, 10, 1.0, 2),
        (0, 11, 0.0, 4),
        (0, 12, 0.0, 1),
        (1, 20, 2.0, 2),
        (1, 21, 4.0, 3),
        (2, 30, 5.0, 2),
    ]
    return [
        Sample(group_index=p, index=i, group_id=g, reward=r, response_length=n, loss_mask=[1] * n)
        for i, (p, g, r, n) in enumerate(spec)
    ]


@pytest.mark.parametrize("estimator", ["grpo", "gspo"])
@pytest.mark.parametrize("std", [True, False])
def test_grpo_uneven_groups_every_token_gets_the_normalised_trajectory_reward(estimator, std):
    samples = _uneven_samples()
    args = _args(advantage_estimator=estimator, disable_grpo_std_normalization=not std)
    rewards = normalize_rewards_from_args(args, samples)
    batch = {
        "rewards": rewards,
        "loss_masks": [s.loss_mask for s in samples],
        "total_lengths": [s.response_length + 2 for s in samples],
        "response_lengths": [s.response_length for s in samples],
    }
    adv, ret = compute_advantages_and_returns(args, batch)
    # hand: prompt 0 over trajectories [1, 0, 0]: mean 1/3, unbiased std sqrt(1/3); prompt 1: mean 3, std sqrt(2)
    s0, s1 = (math.sqrt(1 / 3), math.sqrt(2)) if std else (0.0, 0.0)
    eps = 1e-6 if std else 0.0
    expect = [
        (2 / 3) / (s0 + eps) if std else 2 / 3,
        (2 / 3) / (s0 + eps) if std else 2 / 3,
        (-1 / 3) / (s0 + eps) if std else -1 / 3,
        (-1 / 3) / (s0 + eps) if std else -1 / 3,
        -1 / (s1 + eps) if std else -1.0,
        1 / (s1 + eps) if std else 1.0,
        0.0,  # a prompt with one trajectory has no spread
    ]
    for a, e, s in zip(adv, expect, samples, strict=True):
        assert a.shape == (s.response_length,)
        assert a.tolist() == pytest.approx([e] * s.response_length, rel=1e-6)
    assert ret is adv or all(torch.equal(a, r) for a, r in zip(adv, ret, strict=True))
    # same semantics as the rollout-side helper keyed by prompt index
    direct = normalize_rewards_by_prompt(
        [s.reward for s in samples],
        [s.group_index for s in samples],
        [s.group_id for s in samples],
        std_normalization=std,
    )
    assert [a[0].item() for a in adv] == pytest.approx(direct, rel=1e-6)
    assert all(torch.count_nonzero(k) == 0 for k in batch["kl"])


def test_reinforce_plus_plus_discounted_returns_hand_computed():
    lp = torch.tensor([-1.0, -1.0, -1.0, -1.0, -1.0], dtype=F64)
    ref = lp - torch.tensor([0.2, -0.4, 0.6, 1.0, 0.3], dtype=F64)  # k1 = lp - ref
    batch = {
        "rewards": [1.0],
        "log_probs": [lp],
        "ref_log_probs": [ref],
        "loss_masks": [[1, 1, 0, 1, 0]],
        "total_lengths": [8],
        "response_lengths": [5],
    }
    adv, ret = compute_advantages_and_returns(
        _args(advantage_estimator="reinforce_plus_plus", kl_coef=0.1, gamma=0.5), batch
    )
    # r = -0.1*m*kl = [-0.02, 0.04, 0, -0.1, 0]; +1 at the last unmasked token (3): 0.9
    # G4 = 0, G3 = 0.9, G2 = 0.45, G1 = 0.04 + 0.225, G0 = -0.02 + 0.1325
    assert adv[0].tolist() == pytest.approx([0.1125, 0.265, 0.45, 0.9, 0.0], abs=1e-6)
    assert ret[0].tolist() == pytest.approx([0.1125, 0.265, 0.45, 0.9, 0.0], abs=1e-6)
    assert batch["kl"][0].tolist() == pytest.approx([0.2, -0.4, 0.6, 1.0, 0.3], abs=1e-6)


def test_reinforce_plus_plus_baseline_subtracts_kl_per_token():
    lp = [torch.tensor([-1.0, -2.0]), torch.tensor([-0.5])]
    ref = [torch.tensor([-1.5, -1.0]), torch.tensor([-0.5])]
    batch = {
        "rewards": [0.5, -0.25],
        "log_probs": lp,
        "ref_log_probs": ref,
        "loss_masks": [[1, 1], [1]],
        "total_lengths": [4, 3],
        "response_lengths": [2, 1],
    }
    args = _args(advantage_estimator="reinforce_plus_plus_baseline", kl_coef=0.2, kl_loss_type="k2")
    adv, _ = compute_advantages_and_returns(args, batch)
    # k2 = (lp - ref)^2 / 2 = [0.125, 0.5], [0]
    assert adv[0].tolist() == pytest.approx([0.5 - 0.2 * 0.125, 0.5 - 0.2 * 0.5])
    assert adv[1].tolist() == pytest.approx([-0.25])


def test_rollout_logprobs_feed_the_kl_under_use_rollout_logprobs():
    batch = {
        "rewards": [0.0],
        "log_probs": [torch.tensor([-9.0])],
        "rollout_log_probs": [torch.tensor([-1.0])],
        "ref_log_probs": [torch.tensor([-1.5])],
        "loss_masks": [[1]],
        "total_lengths": [2],
        "response_lengths": [1],
    }
    args = _args(advantage_estimator="reinforce_plus_plus_baseline", kl_coef=1.0, use_rollout_logprobs=True)
    adv, _ = compute_advantages_and_returns(args, batch)
    assert adv[0].item() == pytest.approx(-0.5)


def test_reinforce_plus_plus_cp2_equals_unsliced():
    g = torch.Generator().manual_seed(0)
    totals, resps = [11, 9, 14], [7, 2, 10]
    lp = [torch.randn(r, generator=g, dtype=F64) for r in resps]
    ref = [x + torch.randn(x.shape, generator=g, dtype=F64) * 0.3 for x in lp]
    masks = [[int(v) for v in (torch.rand(r, generator=g) < 0.7).tolist()] for r in resps]
    masks[1] = [0, 0]  # fully masked sample: no reward token
    args = _args(advantage_estimator="reinforce_plus_plus", kl_coef=0.05, gamma=0.9)
    full = {"rewards": [1.0, 2.0, -1.0], "log_probs": lp, "ref_log_probs": ref, "loss_masks": masks}
    full |= {"total_lengths": totals, "response_lengths": resps}
    ref_adv, _ = compute_advantages_and_returns(args, dict(full))
    # loop reference for one sample to pin the cp=1 path too
    k = (lp[0] - ref[0]).tolist()
    last = max(t for t, m in enumerate(masks[0]) if m)
    running, expect = 0.0, [0.0] * resps[0]
    for t in reversed(range(resps[0])):
        running = -0.05 * masks[0][t] * k[t] + (1.0 if t == last else 0.0) + 0.9 * running
        expect[t] = running
    assert ref_adv[0].tolist() == pytest.approx(expect, abs=1e-6)
    assert ref_adv[1].tolist() == [0.0, 0.0]

    def body(ps):
        r = ps.rank("cp")
        local = dict(full)
        local["log_probs"] = [slice_response_for_cp(x, t, n, 2, r) for x, t, n in zip(lp, totals, resps, strict=True)]
        local["ref_log_probs"] = [
            slice_response_for_cp(x, t, n, 2, r) for x, t, n in zip(ref, totals, resps, strict=True)
        ]
        return compute_advantages_and_returns(args, local, ps)[0]

    for r, adv in enumerate(SimulatedWorld(2, cp=2).run(body)):
        for a, e, t, n in zip(adv, ref_adv, totals, resps, strict=True):
            torch.testing.assert_close(a, slice_response_for_cp(e, t, n, 2, r), rtol=1e-6, atol=1e-7)


def test_normalize_advantages_whitens_over_dp_and_cp_like_a_global_loop():
    g = torch.Generator().manual_seed(1)
    # dp rank d holds samples per_dp[d]; each CP rank holds its zigzag part of every response
    per_dp = [[(10, 6), (7, 4)], [(12, 9)]]
    rewards = [[0.3, -1.2], [2.0]]
    masks = [[[int(v) for v in (torch.rand(r, generator=g) < 0.75).tolist()] for _, r in dp] for dp in per_dp]
    # global reference: GRPO advantage = reward on every token; masked mean and unbiased std over all tokens
    vals = [rw for d in range(2) for rw, m in zip(rewards[d], masks[d], strict=True) for mm in m if mm]
    n = len(vals)
    mean = sum(vals) / n
    var = sum((v - mean) ** 2 for v in vals) / (n - 1)
    args = _args(normalize_advantages=True)

    def body(ps):
        d, r = ps.rank("dp"), ps.rank("cp")
        batch = {
            "rewards": rewards[d],
            "loss_masks": masks[d],
            "total_lengths": [t for t, _ in per_dp[d]],
            "response_lengths": [n for _, n in per_dp[d]],
        }
        return d, r, compute_advantages_and_returns(args, batch, ps)[0]

    out = SimulatedWorld(4, cp=2).run(body)
    assert sorted((d, r) for d, r, _ in out) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for d, r, adv in out:
        for a, (t, resp), rw in zip(adv, per_dp[d], rewards[d], strict=True):
            expect = slice_response_for_cp(torch.full((resp,), (rw - mean) / math.sqrt(var + 1e-8)), t, resp, 2, r)
            torch.testing.assert_close(a, expect.float(), rtol=1e-5, atol=1e-6)


def test_unsupported_estimators():
    batch = {"rewards": [1.0], "loss_masks": [[1]], "total_lengths": [2], "response_lengths": [1]}
    with pytest.raises(ValueError, match="ppo"):
        compute_advantages_and_returns(_args(advantage_estimator="ppo"), dict(batch))
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        compute_advantages_and_returns(_args(advantage_estimator="cispo"), dict(batch))
