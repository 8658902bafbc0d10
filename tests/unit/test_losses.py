"""Log-probs, KL estimators, PPO/GSPO/TIS pieces and the assembled loss, checked independently.

References are hand-computed numbers or per-token Python loops over scalars (math / 0-d tensors), never a
second call of the vectorised expressions under test.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import pytest
import torch

from sim.fake_megatron import SimulatedWorld
from slime.algorithms.cp_slicing import slice_packed_for_cp, slice_response_for_cp
from slime.algorithms.kl import compute_approx_kl
from slime.algorithms.logprobs import (
    packed_response_logprobs_and_entropy,
    response_logprobs_and_entropy,
    vocab_parallel_logprobs_and_entropy,
)
from slime.algorithms.loss import loss_function, policy_loss_function, sft_loss_function
from slime.algorithms.policy_loss import (
    compute_policy_loss,
    gspo_ppo_kl,
    icepop_function,
    opsm_keep_masks,
    vanilla_tis_function,
)
from slime.arguments import default_args

pytestmark = pytest.mark.cpu

F64 = torch.float64


def _args(**kw: Any) -> argparse.Namespace:
    """The parser's defaults (GRPO, policy loss, eps_clip 0.2), with the clip's upper bound that validation would
    derive from --eps-clip set explicitly."""
    return default_args(**{"eps_clip_high": 0.2, **kw})


# ---------------------------------------------------------------- log-probs and entropy


def _ref_logprob_entropy(logits: torch.Tensor, targets: torch.Tensor, temperature: float):
    """Row by row, with Python sums over the vocabulary (float64 scalars)."""
    lps, hs = [], []
    for row, t in zip(logits.tolist(), targets.tolist(), strict=True):
        x = [v / temperature for v in row]
        m = max(x)
        z = sum(math.exp(v - m) for v in x)
        logz = m + math.log(z)
        lps.append(x[t] - logz)
        hs.append(-sum(math.exp(v - logz) * (v - logz) for v in x))
    return torch.tensor(lps, dtype=F64), torch.tensor(hs, dtype=F64)


def test_tp1_matches_log_softmax_loop_and_torch():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 11, generator=g, dtype=F64) * 3
    targets = torch.randint(0, 11, (7,), generator=g)
    for temp in (1.0, 0.6, 1.7):
        lp, h = vocab_parallel_logprobs_and_entropy(logits, targets, None, temp)
        ref_lp, ref_h = _ref_logprob_entropy(logits, targets, temp)
        torch.testing.assert_close(lp, ref_lp, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(h, ref_h, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lp, torch.log_softmax(logits / temp, -1).gather(-1, targets[:, None])[:, 0])


def test_float32_logits_give_float32_and_bf16_upcasts():
    logits = torch.randn(3, 5).to(torch.bfloat16)
    lp, h = vocab_parallel_logprobs_and_entropy(logits, torch.tensor([0, 1, 4]), None, 1.0)
    assert lp.dtype == torch.float32 and h.dtype == torch.float32
    ref = torch.log_softmax(logits.float(), -1)[torch.arange(3), torch.tensor([0, 1, 4])]
    torch.testing.assert_close(lp, ref)


def test_gradcheck_float64_single_rank():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 6, generator=g, dtype=F64, requires_grad=True)
    targets = torch.tensor([0, 5, 2, 2])
    assert torch.autograd.gradcheck(lambda x: vocab_parallel_logprobs_and_entropy(x, targets, None, 0.8), (logits,))
    # entropy off: log-probs still differentiable, entropy is a constant zero
    lp, h = vocab_parallel_logprobs_and_entropy(logits, targets, None, 0.8, with_entropy=False)
    assert not h.requires_grad and torch.count_nonzero(h) == 0
    assert torch.autograd.gradcheck(
        lambda x: vocab_parallel_logprobs_and_entropy(x, targets, None, 0.8, with_entropy=False)[0], (logits,)
    )


@pytest.mark.parametrize("tp", [2, 4])
def test_vocab_parallel_values_and_gradients_match_full_vocab(tp):
    g = torch.Generator().manual_seed(tp)
    n, vocab, temp = 9, 4 * 6, 0.7
    logits = torch.randn(n, vocab, generator=g, dtype=F64) * 2
    targets = torch.randint(0, vocab, (n,), generator=g)
    w_lp = torch.randn(n, generator=g, dtype=F64)
    w_h = torch.randn(n, generator=g, dtype=F64)
    shard = vocab // tp

    def body(ps):
        r = ps.rank("tp")
        x = logits[:, r * shard : (r + 1) * shard].clone().requires_grad_()
        lp, h = vocab_parallel_logprobs_and_entropy(x, targets, ps, temp, r * shard, chunk_size=4)
        ((lp * w_lp).sum() + (h * w_h).sum()).backward()
        return lp.detach(), h.detach(), x.grad

    out = SimulatedWorld(tp, tp=tp).run(body)
    ref_x = logits.clone().requires_grad_()
    logp = torch.log_softmax(ref_x / temp, -1)
    ref_lp = logp.gather(-1, targets[:, None])[:, 0]
    ref_h = -(logp.exp() * logp).sum(-1)
    ((ref_lp * w_lp).sum() + (ref_h * w_h).sum()).backward()
    loop_lp, loop_h = _ref_logprob_entropy(logits, targets, temp)
    for lp, h, _ in out:
        torch.testing.assert_close(lp, loop_lp, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(h, loop_h, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.cat([o[2] for o in out], dim=1), ref_x.grad, rtol=1e-10, atol=1e-12)


def test_response_logprobs_packed_and_cp2_match_unsliced():
    g = torch.Generator().manual_seed(3)
    vocab = 8
    totals, resps = [7, 12, 5], [3, 8, 4]
    tokens = [torch.randint(0, vocab, (t,), generator=g) for t in totals]
    logits = torch.randn(sum(totals), vocab, generator=g, dtype=F64)
    # reference: response token j of sample i is predicted by position prompt_len - 1 + j
    ref_lp, off = [], 0
    for tok, t, r in zip(tokens, totals, resps, strict=True):
        rows = [off + t - r - 1 + j for j in range(r)]
        ref_lp.append(_ref_logprob_entropy(logits[rows], tok[t - r :], 1.3)[0])
        off += t
    lp, _ = response_logprobs_and_entropy(logits, tokens, totals, resps, None, temperature=1.3)
    for a, b in zip(lp, ref_lp, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)

    def body(ps):
        local, _ = slice_packed_for_cp(logits, [0, 7, 19, 24], 2, ps.rank("cp"))
        got, _ = response_logprobs_and_entropy(local, tokens, totals, resps, ps, temperature=1.3)
        return got

    for rank, got in enumerate(SimulatedWorld(2, cp=2).run(body)):
        for a, ref, t, r in zip(got, ref_lp, totals, resps, strict=True):
            torch.testing.assert_close(a, slice_response_for_cp(ref, t, r, 2, rank), rtol=1e-12, atol=1e-12)

    # tp=2 x cp=2: vocab shards and zigzag parts at once; and full-vocab logits with vocab_parallel=False
    def body_tp(ps):
        local, _ = slice_packed_for_cp(logits, [0, 7, 19, 24], 2, ps.rank("cp"))
        half = vocab // 2
        shard = local[:, ps.rank("tp") * half : (ps.rank("tp") + 1) * half]
        sharded, _ = response_logprobs_and_entropy(
            shard, tokens, totals, resps, ps, temperature=1.3, vocab_start=ps.rank("tp") * half
        )
        full, _ = response_logprobs_and_entropy(
            local, tokens, totals, resps, ps, temperature=1.3, vocab_parallel=False
        )
        return ps.rank("cp"), sharded, full

    for rank, sharded, full in SimulatedWorld(4, tp=2, cp=2).run(body_tp):
        for a, b, ref, t, r in zip(sharded, full, ref_lp, totals, resps, strict=True):
            torch.testing.assert_close(a, slice_response_for_cp(ref, t, r, 2, rank), rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(b, slice_response_for_cp(ref, t, r, 2, rank), rtol=1e-12, atol=1e-12)


def test_packed_response_logprobs_read_each_samples_rows():
    # A row with a shared prompt (rows 0-2) and two branches (3-5, 6-7), then a sample packed whole (8-12);
    # each sample's log-probs must be those of its own token sequence, read through its rows.
    g = torch.Generator().manual_seed(5)
    vocab = 8
    row_tokens = torch.randint(0, vocab, (13,), generator=g)
    logits = torch.randn(13, vocab, generator=g, dtype=F64)
    rows = [[0, 1, 2, 3, 4, 5], [0, 1, 2, 6, 7], [8, 9, 10, 11, 12]]
    resps = [3, 2, 4]
    ref = []
    for r, n in zip(rows, resps, strict=True):
        lg, tok, t = logits[r], row_tokens[r], len(r)
        ref.append(_ref_logprob_entropy(lg[t - n - 1 : t - 1], tok[t - n :], 0.7))
    lp, ent = packed_response_logprobs_and_entropy(logits, row_tokens, rows, resps, None, temperature=0.7)
    for a, h, (ref_lp, ref_h) in zip(lp, ent, ref, strict=True):
        torch.testing.assert_close(a, ref_lp, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(h, ref_h, rtol=1e-12, atol=1e-12)

    def body(ps):  # tp=2: each rank holds half of the vocabulary
        half = vocab // 2
        shard = logits[:, ps.rank("tp") * half : (ps.rank("tp") + 1) * half]
        return packed_response_logprobs_and_entropy(
            shard, row_tokens, rows, resps, ps, temperature=0.7, vocab_start=ps.rank("tp") * half
        )[0]

    for got in SimulatedWorld(2, tp=2).run(body):
        for a, (ref_lp, _) in zip(got, ref, strict=True):
            torch.testing.assert_close(a, ref_lp, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="needs a prompt token"):
        packed_response_logprobs_and_entropy(logits, row_tokens, [[0, 1]], [2], None)


# ---------------------------------------------------------------- KL estimators


def test_kl_types_hand_computed():
    lp = torch.tensor([-1.0, -2.0, -0.5], dtype=F64)
    base = torch.tensor([-1.5, -2.0, -6.0], dtype=F64)
    # log r = lp - base = [0.5, 0, 5.5]
    torch.testing.assert_close(compute_approx_kl(lp, base, "k1"), torch.tensor([0.5, 0.0, 5.5], dtype=F64))
    torch.testing.assert_close(compute_approx_kl(lp, base, "k2"), torch.tensor([0.125, 0.0, 15.125], dtype=F64))
    k3 = [math.exp(-0.5) - 1 + 0.5, 0.0, math.exp(-5.5) - 1 + 5.5]
    torch.testing.assert_close(compute_approx_kl(lp, base, "k3"), torch.tensor(k3, dtype=F64))
    torch.testing.assert_close(compute_approx_kl(lp, base, "low_var_kl"), torch.tensor(k3, dtype=F64))


def test_low_var_kl_clamps_and_k3_does_not():
    # rho = base - lp = 5: e^5 - 1 - 5 = 142.41...; low_var_kl caps it at 10
    lp, base = torch.tensor([-6.0]), torch.tensor([-1.0])
    assert compute_approx_kl(lp, base, "k3").item() == pytest.approx(math.exp(5) - 6, rel=1e-6)
    assert compute_approx_kl(lp, base, "low_var_kl").item() == 10.0
    # the importance ratio multiplies before the clamp: 0.05 * 142.4 = 7.12 stays under 10
    ratio = torch.tensor([0.05])
    assert compute_approx_kl(lp, base, "low_var_kl", ratio).item() == pytest.approx(0.05 * (math.exp(5) - 6), rel=1e-6)
    assert compute_approx_kl(lp, base, "k1", ratio).item() == pytest.approx(0.05 * -5.0)
    with pytest.raises(ValueError, match="unknown KL type"):
        compute_approx_kl(lp, base, "k4")


# ---------------------------------------------------------------- PPO clip, dual clip


@pytest.mark.parametrize(
    ("adv", "ratio", "c", "pg", "clipped", "dual"),
    [
        (1.0, 1.5, None, -1.2, 1.0, 0.0),  # max(-1.5, -1.2): the clipped term wins
        (1.0, 1.1, None, -1.1, 0.0, 0.0),  # inside the trust region
        (1.0, 0.5, None, -0.5, 0.0, 0.0),  # A>0, low ratio: unclipped (pessimistic) term
        (-1.0, 0.5, None, 0.8, 1.0, 0.0),  # A<0, ratio below 1-eps: clipped 0.8 > 0.5
        (-1.0, 5.0, None, 5.0, 0.0, 0.0),  # A<0, exploding ratio, no dual clip: loss 5
        (-1.0, 5.0, 3.0, 3.0, 0.0, 1.0),  # dual clip caps at -c*A = 3
        (-2.0, 10.0, 3.0, 6.0, 0.0, 1.0),  # min(20, 6)
        (-1.0, 2.0, 3.0, 2.0, 0.0, 0.0),  # under the cap: unchanged
        (1.0, 10.0, 3.0, -1.2, 1.0, 0.0),  # dual clip never touches A>0
    ],
)
def test_policy_loss_hand_cases(adv, ratio, c, pg, clipped, dual):
    ppo_kl = torch.tensor([-math.log(ratio)], dtype=F64)
    loss, clipfrac, dualfrac = compute_policy_loss(ppo_kl, torch.tensor([adv], dtype=F64), 0.2, 0.2, c)
    assert loss.item() == pytest.approx(pg, rel=1e-12)
    assert clipfrac.item() == clipped and dualfrac.item() == dual


def test_asymmetric_eps_clip_high():
    ppo_kl = -torch.log(torch.tensor([1.25, 0.75], dtype=F64))
    loss, clipfrac, _ = compute_policy_loss(ppo_kl, torch.tensor([1.0, -1.0], dtype=F64), 0.2, 0.28)
    # 1.25 < 1 + 0.28 is inside; 0.75 < 1 - 0.2 is clipped up to 0.8 for A<0
    torch.testing.assert_close(loss, torch.tensor([-1.25, 0.8], dtype=F64))
    assert clipfrac.tolist() == [0.0, 1.0]
    with pytest.raises(ValueError, match="eps_clip_c"):
        compute_policy_loss(ppo_kl, torch.ones(2, dtype=F64), 0.2, 0.2, 1.0)


# ---------------------------------------------------------------- GSPO, OPSM, TIS


def test_gspo_sequence_ratio_hand_case():
    lp = torch.tensor([-1.0, -2.0, -3.0], dtype=F64, requires_grad=True)
    old = torch.tensor([-1.1, -2.3, -2.0], dtype=F64)
    mask = torch.tensor([1.0, 1.0, 0.0], dtype=F64)
    (k,) = gspo_ppo_kl([lp], [old], [mask], None)
    # masked mean of (lp - old) = (0.1 + 0.3) / 2 = 0.2, on every token (also the masked one)
    torch.testing.assert_close(k, torch.full((3,), -0.2, dtype=F64))
    loss, clipfrac, _ = compute_policy_loss(k, torch.ones(3, dtype=F64), 0.2, 0.3)
    # s = e^0.2 = 1.2214 < 1.3: unclipped, -s per token; d(sum of masked tokens)/d lp_t = -2 s * m_t / 2
    torch.testing.assert_close(loss, torch.full((3,), -math.exp(0.2), dtype=F64))
    (loss * mask).sum().backward()
    torch.testing.assert_close(lp.grad, torch.tensor([-math.exp(0.2), -math.exp(0.2), 0.0], dtype=F64))
    assert clipfrac.sum().item() == 0


def test_gspo_cp2_sequence_ratio_and_gradient_equal_unsliced():
    g = torch.Generator().manual_seed(5)
    total, resp = 13, 9
    lp_full = torch.randn(resp, generator=g, dtype=F64) * 0.1 - 1
    old_full = lp_full + torch.randn(resp, generator=g, dtype=F64) * 0.1
    mask_full = torch.tensor([1, 1, 0, 1, 1, 1, 0, 1, 1], dtype=F64)
    adv = 0.7

    def loss_of(lp, old, mask, ps):
        (k,) = gspo_ppo_kl([lp], [old], [mask], ps)
        pg, _, _ = compute_policy_loss(k, torch.full_like(lp, adv), 0.2, 0.2)
        return (pg * mask).sum() / mask_full.sum()

    ref = lp_full.clone().requires_grad_()
    ref_loss = loss_of(ref, old_full, mask_full, None)
    ref_loss.backward()
    # loop reference of the ratio itself
    s = math.exp(
        sum(m * (a - b) for a, b, m in zip(lp_full.tolist(), old_full.tolist(), mask_full.tolist(), strict=True)) / 7
    )
    assert ref_loss.item() == pytest.approx(-adv * min(s, 1.2), rel=1e-12)  # A>0: pessimistic min(s, 1+eps)

    def body(ps):
        r = ps.rank("cp")
        lp = slice_response_for_cp(lp_full, total, resp, 2, r).clone().requires_grad_()
        loss = loss_of(
            lp,
            slice_response_for_cp(old_full, total, resp, 2, r),
            slice_response_for_cp(mask_full, total, resp, 2, r),
            ps,
        )
        loss.backward()
        return loss.detach(), lp.grad

    out = SimulatedWorld(2, cp=2).run(body)
    torch.testing.assert_close(out[0][0] + out[1][0], ref_loss.detach(), rtol=1e-12, atol=1e-14)
    for r, (_, grad) in enumerate(out):
        torch.testing.assert_close(grad, slice_response_for_cp(ref.grad, total, resp, 2, r), rtol=1e-12, atol=1e-14)


def test_opsm_drops_negative_advantages_of_drifted_sequences():
    lp = [torch.tensor([-1.0, -1.0]), torch.tensor([-1.0, -1.0]), torch.tensor([-1.0])]
    old = [torch.tensor([-0.5, -0.7]), torch.tensor([-1.0, -1.0]), torch.tensor([-0.2])]  # seq kl 0.4, 0, 0.8
    adv = [torch.tensor([-1.0, -1.0]), torch.tensor([-1.0, -1.0]), torch.tensor([2.0])]
    masks = [torch.tensor([1.0, 0.0]), torch.ones(2), torch.ones(1)]
    keep, dropped = opsm_keep_masks(lp, old, adv, masks, 0.1, None)
    # sample 0: masked mean over token 0 only = 0.5 > 0.1 and A<0 -> token 0 dropped (token 1 is masked anyway)
    assert [k.tolist() for k in keep] == [[0.0, 1.0], [1.0, 1.0], [1.0]]
    assert [d.tolist() for d in dropped] == [[1.0, 0.0], [0.0, 0.0], [0.0]]


def test_vanilla_tis_and_icepop_clamps():
    args = _args(tis_clip=2.0, tis_clip_low=0.6)
    old = [torch.tensor([math.log(3.0), math.log(0.5)]), torch.tensor([0.0, math.log(1.5)])]
    roll = [torch.zeros(2), torch.zeros(2)]
    pg = torch.tensor([1.0, 1.0, 1.0, -2.0])
    masks = [torch.ones(2), torch.ones(2)]
    out, m, metrics = vanilla_tis_function(
        args, pg_loss=pg, train_log_probs=old, rollout_log_probs=roll, loss_masks=masks
    )
    torch.testing.assert_close(out, torch.tensor([2.0, 0.6, 1.0, -3.0]))
    assert metrics["tis_clipfrac"].tolist() == [1.0, 1.0, 0.0, 0.0]
    torch.testing.assert_close(metrics["tis"], torch.tensor([3.0, 0.5, 1.0, 1.5]))
    torch.testing.assert_close(metrics["tis_abs"], torch.tensor([2.0, 0.5, 0.0, 0.5]))
    assert m[0] is masks[0]
    out, _, metrics = icepop_function(args, pg_loss=pg, train_log_probs=old, rollout_log_probs=roll, loss_masks=masks)
    torch.testing.assert_close(out, torch.tensor([0.0, 0.0, 1.0, -3.0]))
    assert metrics["tis_clipfrac"].tolist() == [1.0, 1.0, 0.0, 0.0]


# ---------------------------------------------------------------- assembled loss vs a per-token loop


def _kl_scalar(lp, base, kind, ratio=None):
    lr = lp - base
    if kind == "k1":
        v = lr
    elif kind == "k2":
        v = lr * lr / 2
    else:
        v = torch.exp(-lr) - 1 + lr
    if ratio is not None:
        v = ratio * v
    return v.clamp(-10, 10) if kind == "low_var_kl" else v


def _loop_loss(args, batch, log_probs, entropy):
    """The total loss token by token: PPO/GSPO + dual clip + TIS + entropy + KL, group-mean reduced."""
    total = torch.zeros((), dtype=F64)
    old_all = batch["rollout_log_probs"] if args.use_rollout_logprobs else batch.get("log_probs")
    for i, lp in enumerate(log_probs):
        mask = batch["loss_masks"][i].tolist()
        denom = max(float(batch["group_mask_sums"][i]), 1.0)
        old = old_all[i] if old_all else lp.detach()
        if args.advantage_estimator == "gspo":
            num = sum(mask[t] * (lp[t] - old[t]) for t in range(len(mask)))
            seq_ratio = torch.exp(num / max(sum(mask), 1.0))
        for t in range(lp.shape[0]):
            a = float(batch["advantages"][i][t])
            r = seq_ratio if args.advantage_estimator == "gspo" else torch.exp(lp[t] - old[t])
            r_clip = torch.clamp(r, 1 - args.eps_clip, 1 + args.eps_clip_high)
            pg = torch.maximum(-a * r, -a * r_clip)
            if args.eps_clip_c is not None and a < 0:
                pg = torch.minimum(pg, torch.tensor(-args.eps_clip_c * a, dtype=F64))
            if args.use_tis:
                w = math.exp(float(batch["log_probs"][i][t]) - float(batch["rollout_log_probs"][i][t]))
                pg = pg * min(max(w, args.tis_clip_low), args.tis_clip)
            term = pg - args.entropy_coef * entropy[i][t]
            if args.use_kl_loss:
                ratio = torch.exp(lp[t] - old[t]) if args.use_unbiased_kl else None
                kl = _kl_scalar(lp[t], batch["ref_log_probs"][i][t], args.kl_loss_type, ratio)
                term = term + args.kl_loss_coef * kl
            total = total + mask[t] * term / denom
    return total


def _batch(seed: int, lengths=(4, 6, 3, 5), groups=(0, 0, 1, 2)):
    g = torch.Generator().manual_seed(seed)
    lp = [torch.randn(n, generator=g, dtype=F64) * 0.3 - 1 for n in lengths]
    masks = [(torch.rand(n, generator=g) < 0.8).to(F64) for n in lengths]
    masks[0][0] = 1.0
    sums: dict[int, float] = {}
    for gid, m in zip(groups, masks, strict=True):
        sums[gid] = sums.get(gid, 0.0) + m.sum().item()
    batch = {
        "advantages": [
            torch.full((n,), float(v), dtype=F64) for n, v in zip(lengths, (1.5, -2.0, -0.5, 0.8), strict=True)
        ],
        "loss_masks": masks,
        "group_mask_sums": [sums[gid] for gid in groups],
        "log_probs": [x + torch.randn(x.shape, generator=g, dtype=F64) * 0.4 for x in lp],
        "rollout_log_probs": [x + torch.randn(x.shape, generator=g, dtype=F64) * 0.5 for x in lp],
        "ref_log_probs": [x + torch.randn(x.shape, generator=g, dtype=F64) * 0.6 for x in lp],
        "total_lengths": [n + 3 for n in lengths],
        "response_lengths": list(lengths),
    }
    entropy = [torch.rand(n, generator=g, dtype=F64) * 2 for n in lengths]
    return lp, entropy, batch


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"eps_clip_c": 3.0, "eps_clip_high": 0.28},
        {"entropy_coef": 0.01, "use_kl_loss": True, "kl_loss_coef": 0.1, "kl_loss_type": "k1"},
        {"use_kl_loss": True, "kl_loss_coef": 0.2, "kl_loss_type": "k2"},
        {"use_kl_loss": True, "kl_loss_coef": 0.3, "kl_loss_type": "k3", "use_unbiased_kl": True},
        {"use_kl_loss": True, "kl_loss_coef": 0.3, "kl_loss_type": "low_var_kl"},
        {"use_tis": True, "tis_clip": 1.5, "tis_clip_low": 0.5, "eps_clip_c": 2.0},
        {"use_rollout_logprobs": True},
        {"advantage_estimator": "gspo", "eps_clip": 3e-4, "eps_clip_high": 4e-4},
        {"advantage_estimator": "gspo", "use_kl_loss": True, "kl_loss_coef": 0.1, "entropy_coef": 0.02},
    ],
)
def test_policy_loss_function_matches_token_loop(overrides):
    args = _args(**overrides)
    lp0, entropy, batch = _batch(11)
    lp = [x.clone().requires_grad_() for x in lp0]
    ent = [h.clone().requires_grad_() for h in entropy]
    loss, metrics = policy_loss_function(args, batch, lp, ent)
    loss.backward()
    ref_lp = [x.clone().requires_grad_() for x in lp0]
    ref_ent = [h.clone().requires_grad_() for h in entropy]
    ref = _loop_loss(args, batch, ref_lp, ref_ent)
    ref.backward()
    torch.testing.assert_close(loss.detach(), ref.detach(), rtol=1e-12, atol=1e-13)
    assert metrics["loss"].item() == pytest.approx(ref.item(), rel=1e-12, abs=1e-13)
    for a, b in zip(lp, ref_lp, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-13)
    for a, b in zip(ent, ref_ent, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-13)


def _group_mean(batch, per_token_values):
    """sum_i sum_t m x / max(D_g(i), 1) with plain Python."""
    out = 0.0
    for vals, m, d in zip(per_token_values, batch["loss_masks"], batch["group_mask_sums"], strict=True):
        out += sum(v * mm for v, mm in zip(vals, m.tolist(), strict=True)) / max(d, 1.0)
    return out


def test_metrics_are_group_means_of_the_per_token_quantities():
    args = _args(use_tis=True, eps_clip_c=3.0, use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k3")
    lp, entropy, batch = _batch(7)
    _, metrics = policy_loss_function(args, batch, lp, entropy)
    old, roll, ref = batch["log_probs"], batch["rollout_log_probs"], batch["ref_log_probs"]
    n = range(len(lp))
    ppo_kl = [[o - x for o, x in zip(old[i].tolist(), lp[i].tolist(), strict=True)] for i in n]
    assert metrics["ppo_kl"].item() == pytest.approx(_group_mean(batch, ppo_kl), rel=1e-12)
    abs_diff = [[abs(o - r) for o, r in zip(old[i].tolist(), roll[i].tolist(), strict=True)] for i in n]
    assert metrics["train_rollout_logprob_abs_diff"].item() == pytest.approx(_group_mean(batch, abs_diff), rel=1e-12)
    assert metrics["entropy_loss"].item() == pytest.approx(
        _group_mean(batch, [h.tolist() for h in entropy]), rel=1e-12
    )
    kl = [[math.exp(r - x) - 1 - (r - x) for x, r in zip(lp[i].tolist(), ref[i].tolist(), strict=True)] for i in n]
    assert metrics["kl_loss"].item() == pytest.approx(_group_mean(batch, kl), rel=1e-12)
    clip, lower, ois, tis = [], [], [], []
    for i in n:
        a = batch["advantages"][i][0].item()
        rows_c, rows_l = [], []
        for k in ppo_kl[i]:
            r = math.exp(-k)
            u, c = -a * r, -a * min(max(r, 0.8), 1.2)
            rows_c.append(1.0 if c > u else 0.0)
            rows_l.append(1.0 if a < 0 and -3.0 * a < max(u, c) else 0.0)
        clip.append(rows_c)
        lower.append(rows_l)
        ois.append([math.exp(-k) for k in ppo_kl[i]])
        tis.append([math.exp(o - r) for o, r in zip(old[i].tolist(), roll[i].tolist(), strict=True)])
    assert metrics["pg_clipfrac"].item() == pytest.approx(_group_mean(batch, clip), rel=1e-12)
    assert metrics["pg_clipfrac_lower"].item() == pytest.approx(_group_mean(batch, lower), rel=1e-12)
    assert metrics["ois"].item() == pytest.approx(_group_mean(batch, ois), rel=1e-6)
    assert metrics["tis"].item() == pytest.approx(_group_mean(batch, tis), rel=1e-6)
    assert all(not v.requires_grad for v in metrics.values())


def test_dual_clip_is_forwarded_from_args():
    # one token with A<0 and a ratio of e^3: without c the loss is 20.08, with c=3 it is capped at 3
    batch = {
        "advantages": [torch.tensor([-1.0], dtype=F64)],
        "loss_masks": [torch.ones(1, dtype=F64)],
        "group_mask_sums": [1.0],
        "log_probs": [torch.tensor([-4.0], dtype=F64)],
        "total_lengths": [3],
        "response_lengths": [1],
    }
    lp = [torch.tensor([-1.0], dtype=F64)]
    off, _ = policy_loss_function(_args(), batch, lp, None)
    on, metrics = policy_loss_function(_args(eps_clip_c=3.0), batch, lp, None)
    assert off.item() == pytest.approx(math.exp(3))
    assert on.item() == pytest.approx(3.0) and metrics["pg_clipfrac_lower"].item() == 1.0


def test_rollout_logprobs_are_old_policy_and_missing_old_is_detached_current():
    lp, _, batch = _batch(2)
    _, m_roll = policy_loss_function(_args(use_rollout_logprobs=True), batch, lp, None)
    diff = [
        [r - x for r, x in zip(batch["rollout_log_probs"][i].tolist(), lp[i].tolist(), strict=True)] for i in range(4)
    ]
    assert m_roll["ppo_kl"].item() == pytest.approx(_group_mean(batch, diff), rel=1e-12)
    # the mismatch metric still compares the trainer's recomputed log-probs with the rollout ones
    absd = [
        [
            abs(o - r)
            for o, r in zip(batch["log_probs"][i].tolist(), batch["rollout_log_probs"][i].tolist(), strict=True)
        ]
        for i in range(4)
    ]
    assert m_roll["train_rollout_logprob_abs_diff"].item() == pytest.approx(_group_mean(batch, absd), rel=1e-12)
    # no recompute pass: ratio 1 everywhere, the loss is -group_mean(A)
    no_old = {k: v for k, v in batch.items() if k not in ("log_probs", "rollout_log_probs")}
    loss, metrics = policy_loss_function(_args(), no_old, lp, None)
    ref = -_group_mean(batch, [a.tolist() for a in batch["advantages"]])
    assert loss.item() == pytest.approx(ref, rel=1e-12)
    assert metrics["ppo_kl"].item() == 0.0 and "train_rollout_logprob_abs_diff" not in metrics


def test_tis_rejection_masks_keep_group_denominators():
    lp, _, batch = _batch(4)
    args = _args(use_tis=True, custom_tis_function_path="slime.algorithms.policy_loss.icepop_function", tis_clip=1.2)
    loss, metrics = policy_loss_function(args, batch, lp, None)
    ref = []
    for i in range(4):
        row = []
        for t in range(lp[i].shape[0]):
            w = math.exp(batch["log_probs"][i][t].item() - batch["rollout_log_probs"][i][t].item())
            w = w if w <= 1.2 else 0.0
            r = math.exp(lp[i][t].item() - batch["log_probs"][i][t].item())
            a = batch["advantages"][i][t].item()
            row.append(max(-a * r, -a * min(max(r, 0.8), 1.2)) * w)
        ref.append(row)
    assert loss.item() == pytest.approx(_group_mean(batch, ref), rel=1e-12)
    assert 0 < metrics["tis_clipfrac"].item()


def test_per_token_mode_drops_group_denominators():
    lp, entropy, batch = _batch(9)
    loss, _ = policy_loss_function(_args(calculate_per_token_loss=True, entropy_coef=0.1), batch, lp, entropy)
    ones = dict(batch, group_mask_sums=[1.0] * 4)
    ref = _loop_loss(_args(entropy_coef=0.1), ones, lp, entropy)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-12)


def test_sft_loss_and_dispatch():
    lp, entropy, batch = _batch(6)
    loss, metrics = sft_loss_function(_args(loss_type="sft_loss"), batch, lp, entropy)
    assert loss.item() == pytest.approx(-_group_mean(batch, [x.tolist() for x in lp]), rel=1e-12)
    loss2, _ = loss_function(_args(loss_type="sft_loss"), batch, lp, entropy)
    assert loss2.item() == loss.item() and "entropy_loss" in metrics
    with pytest.raises(ValueError, match="unknown loss type"):
        loss_function(_args(loss_type="nope"), batch, lp, entropy)


def test_empty_microbatch_keeps_graph_and_requires_inputs():
    x = torch.zeros(0, dtype=F64, requires_grad=True)
    batch = {
        "advantages": [torch.zeros(0, dtype=F64)],
        "loss_masks": [torch.zeros(0, dtype=F64)],
        "group_mask_sums": [4.0],
        "total_lengths": [5],
        "response_lengths": [4],
    }
    loss, _ = policy_loss_function(_args(), batch, [x], [x])
    assert loss.item() == 0.0 and loss.requires_grad
    with pytest.raises(ValueError, match="ref_log_probs"):
        policy_loss_function(_args(use_kl_loss=True, kl_loss_coef=0.1), batch, [x], None)
    with pytest.raises(ValueError, match="rollout_log_probs"):
        policy_loss_function(_args(use_tis=True), batch, [x], None)
    with pytest.raises(ValueError, match="entropy"):
        policy_loss_function(_args(entropy_coef=0.1), batch, [x], None)


def test_mismatch_metrics_alone_leave_the_loss_unchanged():
    """--get-mismatch-metrics measures the trainer/engine mismatch; only --use-tis reweights the loss."""
    lp, entropy, batch = _batch(5)
    plain, _ = policy_loss_function(_args(), batch, lp, entropy)
    measured, metrics = policy_loss_function(_args(get_mismatch_metrics=True), batch, lp, entropy)
    reweighted, _ = policy_loss_function(_args(use_tis=True, tis_clip=1.5, tis_clip_low=0.5), batch, lp, entropy)
    assert measured.item() == plain.item()
    assert {"tis", "tis_clipfrac", "tis_abs", "ois"} <= set(metrics)
    assert reweighted.item() != plain.item()
