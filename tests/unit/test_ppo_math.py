"""PPO's pieces against numbers worked out by hand: token rewards, GAE, segment chaining, the clipped value loss.

The random cases (any length, γ, λ, mask, fan-out layout over DP × CP) are in tests/property/test_ppo_gae.py.
"""

from __future__ import annotations

import pytest
import torch

from slime.algorithms.advantages import compute_advantages_and_returns, normalize_rewards_from_args
from slime.algorithms.ppo import gae, ppo_advantages, response_values, token_rewards, value_loss
from slime.algorithms.reducers import make_reducer
from slime.arguments import default_args
from slime.utils.types import Sample

pytestmark = pytest.mark.cpu

F64 = torch.float64


def t(*xs: float) -> torch.Tensor:
    return torch.tensor(xs, dtype=F64)


def test_token_rewards_put_the_reward_on_the_last_unmasked_token():
    out = token_rewards([2.0], [t(0.1, 0.2, 0.3)], [t(1, 1, 0)], kl_coef=0.5)
    torch.testing.assert_close(out[0], t(-0.05, 1.9, 0.0))
    # no KL shaping, a fully masked response: nothing at all (the mask would erase a reward put there)
    out = token_rewards([1.0, 3.0], [t(5, 5), t(1)], [t(1, 1), t(0)], kl_coef=0.0)
    torch.testing.assert_close(out[0], t(0.0, 1.0))
    torch.testing.assert_close(out[1], t(0.0))


def test_gae_by_hand():
    # δ = [0.6 − 0.5, 0.7 − 0.6, 1 − 0.7] = [0.1, 0.1, 0.3]; A2 = 0.3, A1 = 0.1 + 0.5·0.3, A0 = 0.1 + 0.5·0.25
    (adv,) = gae([t(0, 0, 1)], [t(0.5, 0.6, 0.7)], gamma=1.0, lambd=0.5)
    torch.testing.assert_close(adv, t(0.225, 0.25, 0.3))
    # γ = 0.9, λ = 1: A_t is the discounted return minus V_t
    (adv,) = gae([t(1, 0, 2)], [t(0.5, 0.5, 0.5)], gamma=0.9, lambd=1.0)
    torch.testing.assert_close(adv, t(1 + 0.81 * 2 - 0.5, 0.9 * 2 - 0.5, 2 - 0.5))


def _batch(**kw):
    base = {"loss_masks": [[1, 1], [1]], "total_lengths": [5, 4], "response_lengths": [2, 1]}
    return {**base, **kw}


def test_two_segments_are_one_long_sample():
    # trajectory = segment 0 (2 tokens, V 0.2 0.4) then segment 1 (1 token, V 0.5, reward 1 at its end)
    # concatenated: δ = [0.4 − 0.2, 0.5 − 0.4, 1 − 0.5] = [0.2, 0.1, 0.5]; γ = λ = 1: A = [0.8, 0.6, 0.5]
    args = default_args(advantage_estimator="ppo", gamma=1.0, lambd=1.0)
    batch = _batch(rewards=[0.0, 1.0], values=[t(0.2, 0.4), t(0.5)], batch_positions=[0, 1], next_segments=[1, -1])
    adv, ret = ppo_advantages(args, batch)
    torch.testing.assert_close(adv[0], t(0.8, 0.6).float())
    torch.testing.assert_close(adv[1], t(0.5).float())
    torch.testing.assert_close(ret[0], t(1.0, 1.0).float())
    # the same two samples as two trajectories: segment 0 bootstraps from nothing (V := 0 after it)
    batch["next_segments"] = [-1, -1]
    adv, _ = ppo_advantages(args, batch)
    torch.testing.assert_close(adv[0], t(-0.2, -0.4).float())  # δ = [0.4 − 0.2, 0 − 0.4], A0 = 0.2 − 0.4


def test_a_tool_span_is_skipped_the_action_before_it_bootstraps_from_the_one_after():
    # actions at 0 and 3, tokens 1-2 are tool output (mask 0; their values 9 must not matter)
    # δ_3 = 1 − 0.7 = 0.3, A_3 = 0.3; δ_0 = 0.99·0.7 − 0.5 = 0.193, A_0 = 0.193 + 0.99·0.95·0.3 = 0.47515
    args = default_args(advantage_estimator="ppo", gamma=0.99, lambd=0.95)
    batch = {
        "loss_masks": [[1, 0, 0, 1]],
        "total_lengths": [6],
        "response_lengths": [4],
        "rewards": [1.0],
        "values": [t(0.5, 9.0, 9.0, 0.7)],
        "batch_positions": [0],
        "next_segments": [-1],
    }
    adv, ret = ppo_advantages(args, batch)
    torch.testing.assert_close(adv[0], t(0.47515, 0.0, 0.0, 0.3).float())
    torch.testing.assert_close(ret[0], t(0.97515, 0.0, 0.0, 1.0).float())


def test_an_empty_segment_passes_its_successor_through():
    args = default_args(advantage_estimator="ppo", gamma=1.0, lambd=1.0)
    batch = {
        "loss_masks": [[1, 1], [], [1]],
        "total_lengths": [5, 3, 4],
        "response_lengths": [2, 0, 1],
        "rewards": [0.0, 0.0, 1.0],
        "values": [t(0.2, 0.4), t(), t(0.5)],
        "batch_positions": [0, 1, 2],
        "next_segments": [1, 2, -1],
    }
    adv, _ = ppo_advantages(args, batch)
    torch.testing.assert_close(adv[0], t(0.8, 0.6).float())


def test_value_loss_and_clipfrac_by_hand():
    values, old, ret = t(1.0, 0.5, 0.85), t(0.8, 0.8, 0.8), t(1.5, 0.0, 1.0)
    loss, clipfrac = value_loss(values, old, ret, clip=0.1)
    # V_clip = [0.9, 0.7, 0.85]; max((0.9−1.5)², (1−1.5)²) = 0.36; max(0.7², 0.5²) = 0.49; 0.15² both ways
    torch.testing.assert_close(loss, t(0.36, 0.49, 0.0225))
    torch.testing.assert_close(clipfrac, t(1.0, 1.0, 0.0))
    # reduced like every other loss: one token mean per group, groups averaged by the step's b
    reduce = make_reducer([t(1, 1), t(1)], [3.0, 3.0])
    assert reduce([loss[:2], loss[2:]]).item() == pytest.approx((0.36 + 0.49 + 0.0225) / 3)
    assert reduce([clipfrac[:2], clipfrac[2:]]).item() == pytest.approx(2 / 3)


def test_values_are_read_at_the_row_before_each_token():
    out = torch.arange(10, dtype=torch.float32)
    torch.testing.assert_close(response_values(out, [3, 4, 5, 6]), torch.tensor([3.0, 4.0, 5.0]))
    assert response_values(out, [7]).numel() == 0


def test_ppo_rewards_on_the_rollout_side():
    # trajectory 10 fanned out in 2 segments, trajectory 11 alone
    samples = [
        Sample(group_index=0, index=0, group_id=10, reward=1.0, response_length=1),
        Sample(group_index=0, index=1, group_id=10, reward=1.0, response_length=1),
        Sample(group_index=0, index=2, group_id=11, reward=0.5, response_length=1),
    ]
    full = normalize_rewards_from_args(default_args(advantage_estimator="ppo"), samples)
    assert full == [0.0, 1.0, 0.5]  # `full`: each segment carries the reward; the trajectory's is their mean
    for s in samples[:2]:
        s.reward = 0.5
    split = normalize_rewards_from_args(default_args(advantage_estimator="ppo", fan_out_reward="split"), samples)
    assert split == [0.0, 1.0, 0.5]  # `split`: shares of it; the trajectory's is their sum


def test_per_micro_batch_entry_point_refuses_ppo():
    batch = {"rewards": [1.0], "loss_masks": [[1]], "total_lengths": [2], "response_lengths": [1]}
    with pytest.raises(ValueError, match="ppo_advantages"):
        compute_advantages_and_returns(default_args(advantage_estimator="ppo"), batch)
