"""Splitting a trajectory into K segments (fan-out) leaves the loss and its gradient unchanged.

Per-token loss terms x and masks are fixed inputs (not a model whose context changes when split), so the
group token-mean reducer with rollout-side group denominators must give the long sample's loss and
gradient exactly, for every K and every way of scattering the segments over micro-batches.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from slime.algorithms.reducers import sum_of_group_mean
from slime.scheduling import group_mask_sums
from tests.hypothesis_budget import examples

pytestmark = pytest.mark.cpu

RTOL = 1e-12


def _loss_and_grad(x: torch.Tensor, pieces, per_token: bool, n_mb: int, assign):
    """Reduce `pieces` ((group, lo, hi) response slices of x) micro-batch by micro-batch; sum like Megatron."""
    xl = x.detach().clone().requires_grad_()
    masks = [m[lo:hi] for (m, _, lo, hi) in pieces]
    gids = [g for (_, g, _, _) in pieces]
    denoms = group_mask_sums([mm.tolist() for mm in masks], gids)
    total = xl.new_zeros(())
    for mb in range(n_mb):
        idx = [j for j in range(len(pieces)) if assign[j] == mb]
        vals = [xl[pieces[j][2] : pieces[j][3]] for j in idx]
        total = total + sum_of_group_mean(vals, [masks[j] for j in idx], [denoms[j] for j in idx], per_token=per_token)
    total.backward()
    return total.detach(), xl.grad.clone()


@st.composite
def split_case(draw):
    n_groups = draw(st.integers(1, 4))
    resp = [draw(st.integers(1, 24)) for _ in range(n_groups)]
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    n = sum(resp)
    x = torch.randn(n, generator=g, dtype=torch.float64)
    density = draw(st.sampled_from([0.0, 0.3, 0.8, 1.0]))
    m = (torch.rand(n, generator=g, dtype=torch.float64) < density).to(torch.float64)
    return resp, x, m, draw(st.booleans()), draw(st.randoms(use_true_random=False))


@settings(max_examples=examples(200), deadline=None)
@given(split_case())
def test_split_equals_unsplit_for_every_k(case):
    resp, x, m, per_token, rnd = case
    offsets = [sum(resp[:g]) for g in range(len(resp))]
    # reference: each group is one long sample in one micro-batch
    ref_pieces = [(m, g, offsets[g], offsets[g] + resp[g]) for g in range(len(resp))]
    ref_loss, ref_grad = _loss_and_grad(x, ref_pieces, per_token, 1, [0] * len(ref_pieces))
    # every K up to 6, and the extreme where each token is its own segment
    for k in sorted({*range(1, min(max(resp), 6) + 1), max(resp)}):
        pieces = []
        for g, n in enumerate(resp):
            kk = min(k, n)
            cuts = sorted(rnd.sample(range(1, n), kk - 1)) if kk > 1 else []
            bounds = [0, *cuts, n]
            pieces += [(m, g, offsets[g] + a, offsets[g] + b) for a, b in itertools.pairwise(bounds)]
        n_mb = rnd.randint(1, len(pieces))
        assign = [rnd.randrange(n_mb) for _ in pieces]
        loss, grad = _loss_and_grad(x, pieces, per_token, n_mb, assign)
        # summation order differs, so allow rounding on a loss near zero; the gradient needs no slack
        torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=1e-13)
        torch.testing.assert_close(grad, ref_grad, rtol=RTOL, atol=0)


def test_unsplit_reference_is_the_token_mean():
    # one group: the loss is the plain masked token mean, and 1 sample per group is the classic per-sample mean
    x = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    m = torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=torch.float64)
    loss, grad = _loss_and_grad(x, [(m, 0, 0, 2), (m, 0, 2, 4)], False, 2, [0, 1])
    assert loss.item() == pytest.approx((1 + 3 + 4) / 3, rel=1e-15)
    torch.testing.assert_close(grad, m / 3, rtol=RTOL, atol=0)
