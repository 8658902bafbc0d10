"""GAE as slime computes it equals the per-token recursion, for random lengths, γ, λ, masks and fan-out groups.

The reference is the textbook loop over one sequence (δ_t = r_t + γ·V_{t+1} − V_t with V := 0 at the end,
A_t = δ_t + γλ·A_{t+1}), run over the *action tokens only* (loss mask 1) of each trajectory's segments
concatenated in batch order: a group of segments is one long sample, and a masked span (tool output) is skipped,
so the action before it bootstraps from the first action after it. Masked tokens get advantage and return 0.
slime's side is the chunked scan and, across simulated DP × CP ranks holding the segments in any arrangement,
`ppo_advantages` with its one summary all-reduce. A second oracle is verl 0.9.1's own masked loop
(`compute_gae_advantage_return`), which must agree on every action token.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.fake_megatron import SimulatedWorld
from slime.algorithms.cp_slicing import slice_response_for_cp
from slime.algorithms.ppo import gae, token_rewards
from slime.arguments import default_args
from tests.hypothesis_budget import examples

pytestmark = pytest.mark.cpu

F64 = torch.float64


def loop_gae(rewards: list[float], values: list[float], gamma: float, lambd: float) -> list[float]:
    out = [0.0] * len(rewards)
    last = 0.0
    for t in range(len(rewards) - 1, -1, -1):
        nxt = values[t + 1] if t + 1 < len(rewards) else 0.0
        last = rewards[t] + gamma * nxt - values[t] + gamma * lambd * last
        out[t] = last
    return out


unit = st.floats(0.0, 1.0, allow_nan=False)


@given(
    lengths=st.lists(st.integers(0, 40), min_size=1, max_size=6),
    gamma=unit,
    lambd=unit,
    chunk=st.integers(1, 17),
    seed=st.integers(0, 2**31 - 1),
)
def test_chunked_scan_equals_the_per_token_loop(lengths, gamma, lambd, chunk, seed):
    g = torch.Generator().manual_seed(seed)
    rewards = [torch.randn(n, generator=g, dtype=F64) for n in lengths]
    values = [torch.randn(n, generator=g, dtype=F64) for n in lengths]
    got = gae(rewards, values, gamma, lambd, chunk=chunk)
    default = gae(rewards, values, gamma, lambd)
    for r, v, a, d in zip(rewards, values, got, default, strict=True):
        expect = torch.tensor(loop_gae(r.tolist(), v.tolist(), gamma, lambd), dtype=F64)
        torch.testing.assert_close(a, expect, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(d, expect, rtol=1e-9, atol=1e-9)


def verl_gae(rewards: list[float], values: list[float], mask: list[int], gamma: float, lambd: float) -> list[float]:
    """verl 0.9.1 `compute_gae_advantage_return` for one row: masked tokens carry the next action's value and advantage."""
    nextvalues, lastgaelam, out = 0.0, 0.0, [0.0] * len(rewards)
    for t in range(len(rewards) - 1, -1, -1):
        cand = rewards[t] + gamma * nextvalues - values[t] + gamma * lambd * lastgaelam
        if mask[t]:
            nextvalues, lastgaelam = values[t], cand
        out[t] = lastgaelam
    return out


@st.composite
def fan_out_batches(draw):
    """Trajectories of 1–3 segments in batch order, spread over dp ranks; masks, rewards, log-probs, values."""
    rng = random.Random(draw(st.integers(0, 2**31 - 1)))
    dp, cp = draw(st.sampled_from([(1, 1), (2, 1), (3, 1), (1, 2), (2, 2)]))
    n_traj = draw(st.integers(1, 5))
    samples = []  # (group, prompt_len, response_len, mask, reward)
    for gid in range(n_traj):
        k = rng.choice([1, 1, 2, 3])
        for _ in range(k):
            resp = rng.choice([0, 1, 2, 5, 9, 13, 30])
            p_act = rng.choice([0.3, 0.8, 1.0])  # 0.3: mostly tool output, long masked spans inside the response
            mask = [int(rng.random() < p_act) for _ in range(resp)]
            samples.append((gid, rng.randint(1, 6), resp, mask, rng.uniform(-1, 2)))
    rng.shuffle(samples)  # batch order interleaves groups; a group's segments keep their relative order below
    order: dict[int, list[int]] = {}
    for pos, s in enumerate(samples):
        order.setdefault(s[0], []).append(pos)
    # the rollout side's rule: the trajectory's reward on its last segment, 0 on the others
    rewards = [s[4] if order[s[0]][-1] == pos else 0.0 for pos, s in enumerate(samples)]
    nexts = []
    for pos, s in enumerate(samples):
        seq = order[s[0]]
        i = seq.index(pos)
        nexts.append(seq[i + 1] if i + 1 < len(seq) else -1)
    owner = [rng.randrange(dp) for _ in samples]
    gamma = draw(unit)
    lambd = draw(unit)
    kl_coef = draw(st.sampled_from([0.0, 0.1]))
    return dp, cp, samples, rewards, nexts, owner, gamma, lambd, kl_coef, rng.randrange(2**31)


@settings(max_examples=examples(300))
@given(fan_out_batches())
def test_fan_out_group_is_one_long_sample_on_any_layout(case):
    dp, cp, samples, rewards, nexts, owner, gamma, lambd, kl_coef, seed = case
    g = torch.Generator().manual_seed(seed)
    resp = [s[2] for s in samples]
    totals = [s[1] + s[2] for s in samples]
    masks = [torch.tensor(s[3], dtype=F64) for s in samples]
    values = [torch.randn(n, generator=g, dtype=F64) for n in resp]
    lp = [torch.randn(n, generator=g, dtype=F64) * 0.1 - 1 for n in resp]
    ref_lp = [torch.randn(n, generator=g, dtype=F64) * 0.1 - 1 for n in resp]

    # reference: per-token loop over the action tokens of each trajectory's concatenated segments
    kl = [a - b for a, b in zip(lp, ref_lp, strict=True)]  # k1
    tok = token_rewards(rewards, kl, masks, kl_coef)
    ref_adv: dict[int, torch.Tensor] = {}
    groups: dict[int, list[int]] = {}
    for pos, s in enumerate(samples):
        groups.setdefault(s[0], []).append(pos)
    for seq in groups.values():
        where = [(p, t) for p in seq for t in range(resp[p]) if samples[p][3][t]]
        a = loop_gae([float(tok[p][t]) for p, t in where], [float(values[p][t]) for p, t in where], gamma, lambd)
        for p in seq:
            ref_adv[p] = torch.zeros(resp[p], dtype=F64)
        for (p, t), x in zip(where, a, strict=True):
            ref_adv[p][t] = x
        # verl's masked loop over the whole concatenation agrees on every action token
        m = [x for p in seq for x in samples[p][3]]
        v = verl_gae(
            torch.cat([tok[p] for p in seq]).tolist(), torch.cat([values[p] for p in seq]).tolist(), m, gamma, lambd
        )
        assert all(
            abs(x - y) < 1e-9 for x, y, k in zip(v, torch.cat([ref_adv[p] for p in seq]).tolist(), m, strict=True) if k
        )

    args = default_args(advantage_estimator="ppo", gamma=gamma, lambd=lambd, kl_coef=kl_coef, kl_loss_type="k1")

    def body(ps):
        d, c = ps.rank("dp"), ps.rank("cp")
        mine = [p for p in range(len(samples)) if owner[p] == d]

        def part(xs):
            return [slice_response_for_cp(xs[p], totals[p], resp[p], cp, c) for p in mine]

        batch = {
            "rewards": [rewards[p] for p in mine],
            "loss_masks": [masks[p] for p in mine],
            "total_lengths": [totals[p] for p in mine],
            "response_lengths": [resp[p] for p in mine],
            "values": part(values),
            "log_probs": part(lp),
            "ref_log_probs": part(ref_lp),
            "batch_positions": mine,
            "next_segments": [nexts[p] for p in mine],
        }
        from slime.algorithms.ppo import ppo_advantages

        adv, ret = ppo_advantages(args, batch, ps)
        return d, c, mine, adv, ret, part(values), part([m for m in masks])

    for _d, c, mine, adv, ret, vals, msk in SimulatedWorld(dp * cp, cp=cp).run(body):
        for p, a, r, v, m in zip(mine, adv, ret, vals, msk, strict=True):
            expect = slice_response_for_cp(ref_adv[p], totals[p], resp[p], cp, c).float()
            torch.testing.assert_close(a, expect, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(r, ((expect.double() + v) * m).float(), rtol=1e-5, atol=1e-5)
