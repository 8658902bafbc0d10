"""Properties of log-probs, KL, PPO clipping and the assembled loss over random inputs and layouts.

References are scalar loops (math) or the unsharded / unsliced computation; layouts (tp vocab shards,
cp zigzag parts, dp shards) run on `SimulatedWorld`.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.fake_megatron import SimulatedWorld
from slime.algorithms.advantages import distributed_masked_whiten
from slime.algorithms.cp_slicing import slice_response_for_cp
from slime.algorithms.kl import compute_approx_kl
from slime.algorithms.logprobs import vocab_parallel_logprobs_and_entropy
from slime.algorithms.loss import policy_loss_function
from slime.algorithms.policy_loss import compute_policy_loss
from slime.arguments import default_args
from tests.hypothesis_budget import examples

pytestmark = pytest.mark.cpu

F64 = torch.float64
finite = st.floats(-8.0, 8.0, allow_nan=False)


@settings(max_examples=examples(200), deadline=None)
@given(
    tp=st.sampled_from([1, 2, 4]),
    rows=st.integers(0, 6),
    shard=st.integers(1, 5),
    temperature=st.floats(0.3, 2.0),
    scale=st.sampled_from([0.1, 1.0, 10.0, 60.0]),
    chunk=st.sampled_from([-1, 1, 2]),
    seed=st.integers(0, 2**31 - 1),
)
def test_vocab_parallel_equals_full_vocab(tp, rows, shard, temperature, scale, chunk, seed):
    g = torch.Generator().manual_seed(seed)
    vocab = tp * shard
    logits = torch.randn(rows, vocab, generator=g, dtype=F64) * scale
    targets = torch.randint(0, vocab, (rows,), generator=g)
    w = torch.randn(2, rows, generator=g, dtype=F64)

    def body(ps):
        r = ps.rank("tp")
        x = logits[:, r * shard : (r + 1) * shard].clone().requires_grad_()
        lp, h = vocab_parallel_logprobs_and_entropy(x, targets, ps, temperature, r * shard, chunk_size=chunk)
        ((lp * w[0]).sum() + (h * w[1]).sum()).backward()
        return lp.detach(), h.detach(), x.grad

    out = SimulatedWorld(tp, tp=tp).run(body)
    ref_x = logits.clone().requires_grad_()
    logp = torch.log_softmax(ref_x / temperature, -1)
    ref_lp = logp.gather(-1, targets[:, None])[:, 0]
    ref_h = -(logp.exp() * logp).sum(-1)
    ((ref_lp * w[0]).sum() + (ref_h * w[1]).sum()).backward()
    for lp, h, _ in out:
        torch.testing.assert_close(lp, ref_lp.detach(), rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(h, ref_h.detach(), rtol=1e-9, atol=1e-9)
        assert bool((h >= -1e-12).all()) and bool((lp <= 1e-12).all())
    grad = torch.cat([o[2] for o in out], dim=1) if rows else ref_x.grad
    torch.testing.assert_close(grad, ref_x.grad, rtol=1e-8, atol=1e-10)


def _ppo_scalar(log_ratio: float, a: float, lo: float, hi: float, c: float | None) -> tuple[float, float]:
    r = math.exp(log_ratio)
    unclipped, clipped = -a * r, -a * min(max(r, 1 - lo), 1 + hi)
    pg = max(unclipped, clipped)
    if c is not None and a < 0:
        pg = min(pg, -c * a)
    return pg, 1.0 if clipped > unclipped else 0.0


@settings(max_examples=examples(300), deadline=None)
@given(
    vals=st.lists(st.tuples(finite, finite), min_size=1, max_size=12),
    lo=st.floats(0.01, 0.5),
    hi=st.floats(0.01, 0.8),
    c=st.one_of(st.none(), st.floats(1.01, 10.0)),
)
def test_policy_loss_matches_scalar_loop(vals, lo, hi, c):
    log_ratio = torch.tensor([v[0] for v in vals], dtype=F64)
    adv = torch.tensor([v[1] for v in vals], dtype=F64)
    pg, clipfrac, _ = compute_policy_loss(-log_ratio, adv, lo, hi, c)
    for i, (lr, a) in enumerate(vals):
        ref_pg, ref_clip = _ppo_scalar(lr, a, lo, hi, c)
        assert pg[i].item() == pytest.approx(ref_pg, rel=1e-12, abs=1e-12)
        assert clipfrac[i].item() == ref_clip
        if c is not None and a < 0:
            assert pg[i].item() <= -c * a + 1e-9  # the dual-clip bound holds


@settings(max_examples=examples(300), deadline=None)
@given(
    pairs=st.lists(st.tuples(finite, finite), min_size=1, max_size=10),
    kind=st.sampled_from(["k1", "k2", "k3", "low_var_kl"]),
)
def test_kl_estimators_match_scalar_loop(pairs, kind):
    lp = torch.tensor([p[0] for p in pairs], dtype=F64)
    base = torch.tensor([p[1] for p in pairs], dtype=F64)
    kl = compute_approx_kl(lp, base, kind)
    for i, (a, b) in enumerate(pairs):
        lr = a - b
        ref = {"k1": lr, "k2": lr * lr / 2}.get(kind, math.exp(-lr) - 1 + lr)
        if kind == "low_var_kl":
            ref = min(max(ref, -10.0), 10.0)
        assert kl[i].item() == pytest.approx(ref, rel=1e-12, abs=1e-12)
        if kind in ("k2", "k3", "low_var_kl"):
            assert kl[i].item() >= -1e-15 * (1 + abs(lr))  # non-negative estimators


@st.composite
def cp_case(draw):
    n = draw(st.integers(1, 4))
    resp = [draw(st.integers(0, 9)) for _ in range(n)]
    prompt = [draw(st.integers(1, 5)) for _ in range(n)]
    groups = [draw(st.integers(0, 2)) for _ in range(n)]
    overrides = draw(
        st.sampled_from(
            [
                {},
                {"advantage_estimator": "gspo"},
                {"eps_clip_c": 3.0, "use_kl_loss": True, "kl_loss_type": "low_var_kl"},
                {"use_tis": True, "entropy_coef": 0.01},
                {"use_opsm": True, "opsm_delta": 0.01},
            ]
        )
    )
    return resp, prompt, groups, overrides, draw(st.integers(0, 2**31 - 1))


@settings(max_examples=examples(100), deadline=None)
@given(case=cp_case())
def test_loss_over_cp_ranks_sums_to_the_unsliced_loss(case):
    resp, prompt, groups, overrides, seed = case
    g = torch.Generator().manual_seed(seed)
    totals = [p + r for p, r in zip(prompt, resp, strict=True)]
    lp = [torch.randn(r, generator=g, dtype=F64) * 0.2 - 1 for r in resp]
    masks = [(torch.rand(r, generator=g) < 0.8).to(F64) for r in resp]
    den: dict[int, float] = {}
    for gid, m in zip(groups, masks, strict=True):
        den[gid] = den.get(gid, 0.0) + m.sum().item()
    full = {
        "advantages": [torch.full((r,), torch.randn((), generator=g).item(), dtype=F64) for r in resp],
        "loss_masks": masks,
        "group_mask_sums": [den[gid] for gid in groups],
        "log_probs": [x + torch.randn(x.shape, generator=g, dtype=F64) * 0.1 for x in lp],
        "rollout_log_probs": [x + torch.randn(x.shape, generator=g, dtype=F64) * 0.1 for x in lp],
        "ref_log_probs": [x + torch.randn(x.shape, generator=g, dtype=F64) * 0.1 for x in lp],
        "total_lengths": totals,
        "response_lengths": resp,
    }
    entropy = [torch.rand(r, generator=g, dtype=F64) for r in resp]
    args = default_args(
        **{
            "advantage_estimator": "grpo",
            "eps_clip": 0.2,
            "eps_clip_high": 0.25,
            "kl_loss_coef": 0.1,
            "kl_loss_type": "k1",
            "tis_clip": 1.5,
            "tis_clip_low": 0.5,
            **overrides,
        }
    )
    ref_lp = [x.clone().requires_grad_() for x in lp]
    ref_loss, ref_metrics = policy_loss_function(args, full, ref_lp, entropy, None)
    ref_loss.backward()

    def body(ps):
        r = ps.rank("cp")

        def cut(xs):
            return [slice_response_for_cp(x, t, n, 2, r) for x, t, n in zip(xs, totals, resp, strict=True)]

        local = dict(full)
        for key in ("advantages", "loss_masks", "log_probs", "rollout_log_probs", "ref_log_probs"):
            local[key] = cut(full[key])
        x = [t.clone().requires_grad_() for t in cut(lp)]
        loss, metrics = policy_loss_function(args, local, x, cut(entropy), ps)
        loss.backward()
        return loss.detach(), metrics, [t.grad for t in x]

    out = SimulatedWorld(2, cp=2).run(body)
    torch.testing.assert_close(out[0][0] + out[1][0], ref_loss.detach(), rtol=1e-10, atol=1e-12)
    for key, value in ref_metrics.items():
        torch.testing.assert_close(out[0][1][key] + out[1][1][key], value, rtol=1e-10, atol=1e-12)
    for r, (_, _, grads) in enumerate(out):
        for got, ref, t, n in zip(grads, ref_lp, totals, resp, strict=True):
            torch.testing.assert_close(got, slice_response_for_cp(ref.grad, t, n, 2, r), rtol=1e-10, atol=1e-12)


@settings(max_examples=examples(100), deadline=None)
@given(
    layout=st.sampled_from([(1, 1), (2, 1), (1, 2), (2, 2), (4, 1)]),
    lengths=st.lists(st.integers(0, 6), min_size=1, max_size=12),
    seed=st.integers(0, 2**31 - 1),
)
def test_whitening_equals_global_reference(layout, lengths, seed):
    dp, cp = layout
    g = torch.Generator().manual_seed(seed)
    values = [torch.randn(n, generator=g, dtype=F64) * 3 + 1 for n in lengths]
    masks = [(torch.rand(n, generator=g) < 0.7).to(F64) for n in lengths]
    picked = [
        v for x, m in zip(values, masks, strict=True) for v, mm in zip(x.tolist(), m.tolist(), strict=True) if mm
    ]
    owner = [i % dp for i in range(len(lengths))]

    def body(ps):
        d, r = ps.rank("dp"), ps.rank("cp")
        mine = [i for i in range(len(lengths)) if owner[i] == d]
        # any disjoint split of a rank's tokens over cp works for whitening; use the zigzag one
        cut = [slice_response_for_cp(values[i], lengths[i] + 1, lengths[i], cp, r) for i in mine]
        cut_m = [slice_response_for_cp(masks[i], lengths[i] + 1, lengths[i], cp, r) for i in mine]
        return mine, r, distributed_masked_whiten(cut, cut_m, ps), cut

    out = SimulatedWorld(dp * cp, cp=cp).run(body)
    if not picked:
        for _, _, got, cut in out:
            assert all(torch.equal(a, b) for a, b in zip(got, cut, strict=True))
        return
    n = len(picked)
    mean = sum(picked) / n
    var = sum((v - mean) ** 2 for v in picked) / (n - 1) if n > 1 else 0.0
    for _, _, got, cut in out:
        for a, x in zip(got, cut, strict=True):
            torch.testing.assert_close(a, (x - mean) / math.sqrt(var + 1e-8), rtol=1e-9, atol=1e-9)
