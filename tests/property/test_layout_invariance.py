"""The gradient after the full scaling chain is the same for every (dp, cp, packing, DP assignment).

Each simulated rank (sim.fake_megatron.SimulatedWorld) takes its micro-batches from the production
schedule, keeps only the response tokens its CP rank predicts (production zigzag slicing), reduces them
with the production reducer and pre-scale, then does what Megatron does: divide by num_microbatches (or
keep the sum and count tokens in per-token mode), accumulate gradients, and average (or sum and divide by
the all-reduced token count) over dp×cp. The per-token loss terms x are float64 leaf tensors replicated on
every rank, standing in for parameters. The result must equal the single-rank reference gradient of L_s,
and the metrics must equal L_s. Negative controls show the test can fail.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.fake_megatron import SimulatedWorld
from slime.algorithms.cp_slicing import response_ranges_for_cp
from slime.algorithms.reducers import reduce_train_metrics, rollout_group_mean, scale_for_megatron, sum_of_group_mean
from slime.scheduling import build_schedule, group_mask_sums, sample_mask_sums
from tests.hypothesis_budget import examples

pytestmark = pytest.mark.cpu

RTOL = 1e-12


def _make_case(seed, n_groups, dp, cp, per_token, max_tokens, balance, density=0.7):
    g = torch.Generator().manual_seed(seed)
    group_ids, prompt_lens, resp_lens = [], [], []
    for gi in range(n_groups):
        for _ in range(int(torch.randint(1, 4, (1,), generator=g))):
            group_ids.append(100 + gi)
            prompt_lens.append(int(torch.randint(1, 9, (1,), generator=g)))
            resp_lens.append(int(torch.randint(1, 21, (1,), generator=g)))
    x = [torch.randn(n, generator=g, dtype=torch.float64) for n in resp_lens]
    m = [(torch.rand(n, generator=g, dtype=torch.float64) < density).to(torch.float64) for n in resp_lens]
    return dict(
        group_ids=group_ids,
        total_lens=[p + r for p, r in zip(prompt_lens, resp_lens, strict=True)],
        resp_lens=resp_lens,
        x=x,
        m=m,
        dp=dp,
        cp=cp,
        per_token=per_token,
        max_tokens=max_tokens,
        balance=balance,
    )


def _reference(case):
    """Single rank, no parallelism: L_s computed from its definition, the mean over groups of each group's masked
    token mean (per-token mode: the masked token sum over all samples' token counts)."""
    xs = [t.detach().clone().requires_grad_() for t in case["x"]]
    if case["per_token"]:
        num = sum((x * m).sum() for x, m in zip(xs, case["m"], strict=True))
        loss = num / sum(max(m.sum().item(), 1.0) for m in case["m"])
    else:
        groups = list(dict.fromkeys(case["group_ids"]))
        loss = 0
        for gid in groups:
            idx = [i for i, g in enumerate(case["group_ids"]) if g == gid]
            num = sum((xs[i] * case["m"][i]).sum() for i in idx)
            loss = loss + num / max(sum(case["m"][i].sum().item() for i in idx), 1.0)
        loss = loss / len(groups)
    loss.backward()
    return loss.detach(), torch.cat([x.grad for x in xs])


def _simulate(case, *, prescale_dp_cp=True, local_denoms=False):
    dp, cp, per_token = case["dp"], case["cp"], case["per_token"]
    n_groups = len(set(case["group_ids"]))
    sched = build_schedule(
        case["total_lens"],
        case["group_ids"],
        global_batch_size=n_groups,
        dp_size=dp,
        cp_size=cp,
        use_dynamic_batch_size=True,
        max_tokens_per_gpu=case["max_tokens"],
        balance_data=case["balance"],
    )
    (step,) = sched.steps
    masks_list = [m.tolist() for m in case["m"]]
    denoms = group_mask_sums(masks_list, case["group_ids"])
    sample_totals = sample_mask_sums(masks_list)

    def rank_fn(ps):
        assert ps.size("dp") == dp and ps.size("cp") == cp and ps.size("dp_cp") == dp * cp
        cp_rank = ps.rank("cp")
        xs = [t.detach().clone().requires_grad_() for t in case["x"]]  # this rank's replica
        local = {}
        for mb in step.micro_batches[ps.rank("dp")]:
            for i in mb:
                ranges = response_ranges_for_cp(case["total_lens"][i], case["resp_lens"][i], cp, cp_rank)
                local[i] = torch.cat([torch.arange(a, b) for a, b in ranges]) if ranges else torch.zeros(0, dtype=int)
        if local_denoms:  # the bug the test must catch: denominators from what this rank happens to hold
            own = {}
            for i, idx in local.items():
                own[case["group_ids"][i]] = own.get(case["group_ids"][i], 0.0) + case["m"][i][idx].sum().item()
        metric_sum, tokens = 0.0, torch.tensor(0, dtype=torch.int)
        for mb in step.micro_batches[ps.rank("dp")]:
            vals = [xs[i][local[i]] for i in mb]
            msks = [case["m"][i][local[i]] for i in mb]
            dens = [own[case["group_ids"][i]] if local_denoms else denoms[i] for i in mb]
            r_mb = sum_of_group_mean(vals, msks, dens, per_token=per_token)
            if not mb:  # an empty micro-batch still runs (zero loss, keeps the graph connected)
                r_mb = r_mb + 0.0 * sum(x.sum() for x in xs)
            loss, num_tokens = scale_for_megatron(
                r_mb,
                num_microbatches=step.num_microbatches,
                global_batch_size=step.global_batch_size,
                dp_cp_size=ps.size("dp_cp") if prescale_dp_cp else 1,
                cp_size=cp,
                per_token=per_token,
                sample_token_counts=[sample_totals[i] for i in mb],
            )
            # megatron/core/pipeline_parallel/schedules.py: forward_step_calc_loss
            if not per_token:
                loss = loss / torch.clamp(num_tokens, min=1) / step.num_microbatches
            loss.backward()
            tokens += num_tokens
            metric_sum += r_mb.item()
        grad = torch.cat([x.grad if x.grad is not None else torch.zeros_like(x) for x in xs])
        if per_token:
            # DDP sums (gradient_scaling_factor 1); finalize_model_grads divides by the dp_cp token count
            ps.all_reduce(grad, "sum", "dp_cp")
            total = tokens.to(torch.float64)
            ps.all_reduce(total, "sum", "dp_cp")
            grad = grad / total
        else:
            ps.all_reduce(grad, "avg", "dp_cp")
        metrics = reduce_train_metrics(
            {"loss": metric_sum},
            ps,
            global_batch_size=step.global_batch_size,
            per_token=per_token,
            local_num_tokens=float(tokens),
        )
        return grad, metrics["loss"]

    return SimulatedWorld(dp * cp, cp=cp).run(rank_fn)


def _check(case, **broken):
    ref_loss, ref_grad = _reference(case)
    results = _simulate(case, **broken)
    for grad, metric in results:
        torch.testing.assert_close(grad, ref_grad, rtol=RTOL, atol=0)
        assert metric == pytest.approx(ref_loss.item(), rel=RTOL, abs=1e-13)
    return ref_loss


@st.composite
def layout_case(draw):
    dp = draw(st.integers(1, 4))
    cp = draw(st.integers(1, 8 // dp if dp > 1 else 3))
    return _make_case(
        seed=draw(st.integers(0, 2**31 - 1)),
        n_groups=draw(st.integers(dp, 6)),
        dp=dp,
        cp=cp,
        per_token=draw(st.booleans()),
        max_tokens=draw(st.integers(4, 40)),
        balance=draw(st.booleans()),
        density=draw(st.sampled_from([0.0, 0.5, 0.9, 1.0])),
    )


@settings(max_examples=examples(200), deadline=None)
@given(layout_case())
def test_gradient_is_layout_invariant(case):
    ref_loss = _check(case)
    if not case["per_token"]:
        # the rollout side logs the same quantity from the same denominators
        s, n = rollout_group_mean([x.tolist() for x in case["x"]], [m.tolist() for m in case["m"]], case["group_ids"])
        assert s / n == pytest.approx(ref_loss.item(), rel=RTOL, abs=1e-13)


# a layout where every bug shows: groups spread over 2 DP ranks and 2 CP ranks, partly masked
NEG_CASE = dict(seed=7, n_groups=3, dp=2, cp=2, per_token=False, max_tokens=6, balance=False)


def test_negative_control_reference_layout_passes():
    _check(_make_case(**NEG_CASE))


def test_negative_control_without_dp_cp_prescale_fails():
    with pytest.raises(AssertionError, match="not close"):
        _check(_make_case(**NEG_CASE), prescale_dp_cp=False)


def test_negative_control_rank_local_denominators_fail():
    with pytest.raises(AssertionError, match="not close"):
        _check(_make_case(**NEG_CASE), local_denoms=True)
