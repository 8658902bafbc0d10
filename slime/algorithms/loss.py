"""The assembled per-micro-batch loss: pg loss, entropy bonus, KL loss, TIS, metrics (docs/algorithms.md#policy-loss).

Integration contract (what the Megatron train step passes in, for one micro-batch on one rank):

* `log_probs`, `entropy`: per-sample lists of 1-D tensors over the sample's CP-local response tokens, from
  `logprobs.response_logprobs_and_entropy` (they carry the autograd graph back to the logits). `entropy`
  may be None when no entropy was computed (then `--entropy-coef` must be 0).
* `batch`: a mapping with per-sample lists, in the same order —
  `advantages` (list[Tensor], CP-local), `loss_masks` (list[Tensor], CP-local: `slice_response_for_cp` of
  the response mask), `group_mask_sums` (list[float], the *global* D_g of each sample's group, from
  `slime.scheduling.group_mask_sums`), `total_lengths`, `response_lengths` (list[int]); optional
  `log_probs` (old policy, recomputed; when absent ℓ_old := detached ℓ, the no-recompute shortcut),
  `rollout_log_probs` (SGLang's, CP-local), `ref_log_probs` (CP-local; needed by `--use-kl-loss`).
* `ps`: the rank's ParallelState (only "cp" collectives are used here: GSPO / OPSM sequence means).

Returns (loss, metrics): `loss` is R_mb of `reducers.py` (sum over the micro-batch's samples of their token
sums divided by their group's D_g), *unscaled*: the train step passes it through `scale_for_megatron`.
`metrics` are detached R_mb-style sums of the same reducer, to be summed over micro-batches and then handed
to `reduce_train_metrics` (which divides by b): loss, pg_loss, entropy_loss, pg_clipfrac, ppo_kl, and when
enabled kl_loss, pg_clipfrac_lower (dual clip), train_rollout_logprob_abs_diff, tis/tis_clipfrac/tis_abs/ois,
opsm_clipfrac.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from slime.algorithms.kl import compute_approx_kl
from slime.algorithms.policy_loss import (
    compute_policy_loss,
    gspo_ppo_kl,
    opsm_keep_masks,
    vanilla_tis_function,
)
from slime.algorithms.reducers import make_reducer
from slime.parallel_state import ParallelState
from slime.utils.misc import load_function

logger = logging.getLogger(__name__)

LossResult = tuple[torch.Tensor, dict[str, torch.Tensor]]


def _split(x: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return list(x.split([t.shape[0] for t in like]))


def _cat(xs: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat(list(xs)) if xs else torch.zeros(0)


def _graph_anchor(log_probs: Sequence[torch.Tensor]) -> torch.Tensor:
    """0·sum(ℓ): keeps the logits in the graph when this rank holds no response token (every rank runs backward)."""
    return _cat(log_probs).sum() * 0


def _old_log_probs(args: Any, batch: Mapping[str, Any], log_probs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    if args.use_rollout_logprobs:
        roll = batch.get("rollout_log_probs")
        if not roll:
            raise ValueError("--use-rollout-logprobs needs batch['rollout_log_probs']")
        return list(roll)
    old = batch.get("log_probs")
    return list(old) if old else [lp.detach() for lp in log_probs]


def _detached(metrics: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in metrics.items()}


def policy_loss_function(
    args: Any,
    batch: Mapping[str, Any],
    log_probs: Sequence[torch.Tensor],
    entropy: Sequence[torch.Tensor] | None,
    ps: ParallelState | None = None,
) -> LossResult:
    """PPO / GSPO surrogate with dual clip, OPSM, TIS, entropy bonus and KL loss, reduced per group."""
    # Elementwise terms are computed on the micro-batch's concatenated tokens (`*_all`), one op each: a
    # micro-batch holds hundreds of short samples, and per-sample ops cost more than the math. Only the
    # sequence-level pieces (GSPO, OPSM, TIS hooks) take per-sample lists.
    masks = list(batch["loss_masks"])
    denoms = list(batch["group_mask_sums"])
    per_token = bool(args.calculate_per_token_loss)
    reduce = make_reducer(masks, denoms, per_token=per_token)
    log_probs = list(log_probs)
    lp_all = _cat(log_probs)
    dtype = lp_all.dtype
    old = _old_log_probs(args, batch, log_probs)
    old_all = _cat(old).to(dtype)
    adv_all = _cat(batch["advantages"]).to(dtype)

    if args.advantage_estimator == "gspo":
        ppo_kl_all = _cat(gspo_ppo_kl(log_probs, old, masks, ps))
    else:
        ppo_kl_all = old_all - lp_all
    eps_high = args.eps_clip_high
    pg, clipfrac, dualfrac = compute_policy_loss(
        ppo_kl_all,
        adv_all,
        args.eps_clip,
        args.eps_clip if eps_high is None else eps_high,
        args.eps_clip_c,
    )
    metrics: dict[str, torch.Tensor] = {}

    if args.use_opsm:
        advantages = _split(adv_all, log_probs)
        keep, dropped = opsm_keep_masks(log_probs, old, advantages, masks, args.opsm_delta, ps)
        pg = pg * _cat(keep)
        metrics["opsm_clipfrac"] = reduce(dropped)

    pg_masks = masks
    rollout = batch.get("rollout_log_probs")
    # the trainer's own π_old, even under --use-rollout-logprobs: TIS and the mismatch metric compare it with μ
    train_lp = list(batch["log_probs"]) if batch.get("log_probs") else [lp.detach() for lp in log_probs]
    if args.use_tis or args.get_mismatch_metrics:
        if not rollout:
            raise ValueError("--use-tis / --get-mismatch-metrics need batch['rollout_log_probs']")
        path = args.custom_tis_function_path
        tis_fn: Callable[..., Any] = load_function(path) if path else vanilla_tis_function
        weighted, tis_masks, tis_metrics = tis_fn(
            args=args,
            pg_loss=pg,
            train_log_probs=train_lp,
            rollout_log_probs=list(rollout),
            loss_masks=masks,
            total_lengths=batch.get("total_lengths"),
            response_lengths=batch.get("response_lengths"),
        )
        if args.use_tis:  # --get-mismatch-metrics alone only measures the mismatch
            pg, pg_masks = weighted, tis_masks
        # Mismatch metrics over the original masks; the pg numerator over the (possibly rejection-) modified
        # masks, with the original group denominators D_g (a masked token lowers its group's mean).
        metrics["ois"] = reduce(torch.exp(-ppo_kl_all.detach()))
        for name, value in tis_metrics.items():
            metrics[name] = reduce(value.detach().to(pg.dtype))
    pg_reduce = make_reducer(pg_masks, denoms, per_token=per_token) if pg_masks is not masks else reduce

    reducer_path = args.custom_pg_loss_reducer_function_path
    if reducer_path:
        # slime's hook: (total_lengths, response_lengths, loss_masks, per_token) -> fn(concatenated values)
        custom = load_function(reducer_path)(batch["total_lengths"], batch["response_lengths"], pg_masks, per_token)
        pg_loss = custom(pg)
    else:
        pg_loss = pg_reduce(pg)

    metrics["pg_clipfrac"] = reduce(clipfrac)
    metrics["ppo_kl"] = reduce(ppo_kl_all.detach())
    if args.eps_clip_c is not None:
        metrics["pg_clipfrac_lower"] = reduce(dualfrac)
    metrics["pg_loss"] = pg_loss
    loss = pg_loss

    entropy_coef = args.entropy_coef
    if entropy is not None:
        entropy_loss = reduce(_cat(list(entropy)))
        metrics["entropy_loss"] = entropy_loss
        loss = loss - entropy_coef * entropy_loss  # kept in the graph even at coef 0, as slime v0.3.0 does
    elif entropy_coef:
        raise ValueError("--entropy-coef is set but no entropy was computed")

    if args.use_kl_loss:
        ref = batch.get("ref_log_probs")
        if not ref:
            raise ValueError("--use-kl-loss needs batch['ref_log_probs'] (from --ref-load or the initial weights)")
        ratio = torch.exp(lp_all - old_all) if args.use_unbiased_kl else None
        kl_loss = reduce(compute_approx_kl(lp_all, _cat(ref), args.kl_loss_type, importance_ratio=ratio))
        metrics["kl_loss"] = kl_loss
        loss = loss + float(args.kl_loss_coef) * kl_loss

    teacher = batch.get("teacher_log_probs")
    if args.use_opd and teacher:
        # the reverse KL(student ‖ teacher) estimate OPD pulls down, at the current weights
        metrics["opd_reverse_kl"] = reduce(lp_all.detach() - _cat(teacher).to(lp_all.device, dtype))

    if rollout:
        diff = (_cat(train_lp).detach().to(dtype) - _cat(rollout).to(dtype)).abs()
        metrics["train_rollout_logprob_abs_diff"] = reduce(diff)

    loss = loss + _graph_anchor(log_probs)
    metrics["loss"] = loss
    return loss, _detached(metrics)


def sft_loss_function(
    args: Any,
    batch: Mapping[str, Any],
    log_probs: Sequence[torch.Tensor],
    entropy: Sequence[torch.Tensor] | None = None,
    ps: ParallelState | None = None,
) -> LossResult:
    """Negative log-likelihood of the response tokens, group token mean like every other loss."""
    reduce = make_reducer(batch["loss_masks"], batch["group_mask_sums"], per_token=bool(args.calculate_per_token_loss))
    loss = -reduce(list(log_probs)) + _graph_anchor(log_probs)
    metrics = {"loss": loss}
    if entropy is not None:
        metrics["entropy_loss"] = reduce(list(entropy))
    return loss, _detached(metrics)


def loss_function(
    args: Any,
    batch: Mapping[str, Any],
    log_probs: Sequence[torch.Tensor],
    entropy: Sequence[torch.Tensor] | None,
    ps: ParallelState | None = None,
    *,
    logits: torch.Tensor | None = None,
) -> LossResult:
    """Dispatch on `--loss-type`.

    `custom_loss` calls `--custom-loss-function-path` with slime's signature (args, batch, logits, reducer),
    where the reducer takes a list of per-sample tensors (our reducer) instead of slime's concatenated one.
    The critic's value loss is its own micro-batch loss (`slime/backends/megatron/critic.py`).
    """
    loss_type = args.loss_type
    if loss_type == "policy_loss":
        return policy_loss_function(args, batch, log_probs, entropy, ps)
    if loss_type == "sft_loss":
        return sft_loss_function(args, batch, log_probs, entropy, ps)
    if loss_type == "custom_loss":
        fn = load_function(args.custom_loss_function_path)
        reduce = make_reducer(
            batch["loss_masks"],
            batch["group_mask_sums"],
            per_token=bool(args.calculate_per_token_loss),
        )
        return fn(args, batch, logits, reduce)
    raise ValueError(f"unknown loss type {loss_type!r}")
