"""The per-token pieces of the policy-gradient loss: PPO clip, dual clip, GSPO, OPSM, TIS (docs/algorithms.md).

Everything here returns *per-token* tensors; the reduction (group token mean) happens in `loss.py` through
`reducers.make_reducer`, so no function here divides by a token count of its own — except the sequence-level
means of GSPO and OPSM, which are part of the estimator, not of the reduction. Those need the whole
response of a sample while a CP rank holds only its zigzag part, so they all-reduce (sum, count) per sample
over "cp"; the sum goes through `cp_all_reduce_sum`, whose backward all-reduces the gradient (every CP rank
runs backward on its partial loss, as Megatron does).

Conventions: ppo_kl = ℓ_old − ℓ (so ratio = e^{−ppo_kl}); per-sample tensors are 1-D, response-aligned and
CP-local. TIS functions keep slime's hook signature: `pg_loss` concatenated over the micro-batch's samples,
log-probs and masks as per-sample lists, metrics returned as concatenated per-token tensors.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from slime.parallel_state import ParallelState

logger = logging.getLogger(__name__)


def compute_policy_loss(
    ppo_kl: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float,
    eps_clip_c: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pg_loss, clipfrac, dual_clipfrac) per token, for ratio r = e^{−ppo_kl}.

    pg = max(−A·r, −A·clip(r, 1−eps_clip, 1+eps_clip_high)); clipfrac marks tokens where the clipped term
    won. Dual clip (c > 1, only where A < 0): pg = min(pg, −c·A), bounding the loss of a token whose ratio
    exploded on a negative advantage; dual_clipfrac marks where that bound won. slime v0.3.0 never passed c
    to this function (fixed upstream in THUDM/slime#2247); the loss here forwards `--eps-clip-c`.
    """
    ratio = torch.exp(-ppo_kl)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(1 - eps_clip, 1 + eps_clip_high)
    pg = torch.maximum(loss_unclipped, loss_clipped)
    clipfrac = (loss_clipped > loss_unclipped).to(pg.dtype)
    if eps_clip_c is None:
        return pg, clipfrac, torch.zeros_like(clipfrac)
    if eps_clip_c <= 1.0:
        raise ValueError(f"eps_clip_c must be > 1 for dual clip, got {eps_clip_c}")
    bound = -eps_clip_c * advantages
    use_bound = (advantages < 0) & (bound < pg)
    return torch.where(use_bound, bound, pg), clipfrac, use_bound.to(pg.dtype)


class _CPSum(torch.autograd.Function):
    """Sum over the CP group; the backward is the same sum of the gradients (all CP ranks run backward)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, ps: ParallelState, dim: str) -> torch.Tensor:  # type: ignore[override]
        ctx.ps, ctx.dim = ps, dim
        out = x.detach().clone()
        ps.all_reduce(out, "sum", dim)  # type: ignore[arg-type]
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        g = grad.detach().clone()
        ctx.ps.all_reduce(g, "sum", ctx.dim)
        return g, None, None


def cp_all_reduce_sum(x: torch.Tensor, ps: ParallelState | None, dim: str = "cp") -> torch.Tensor:
    """Differentiable sum over `dim` (identity without CP); independent of how `ps.all_reduce` handles autograd."""
    if ps is None or ps.size(dim) == 1:  # type: ignore[arg-type]
        return x
    return _CPSum.apply(x, ps, dim)


def sequence_masked_means(
    values: Sequence[torch.Tensor], masks: Sequence[torch.Tensor], ps: ParallelState | None
) -> list[torch.Tensor]:
    """Per sample, sum(m·v)/max(sum m, 1) over the *whole* response (CP parts combined in one collective)."""
    if not values:
        return []
    dtype = torch.promote_types(values[0].dtype, torch.float32)
    sums = torch.stack([(v.to(dtype) * m.to(dtype)).sum() for v, m in zip(values, masks, strict=True)])
    counts = torch.stack([m.to(dtype).sum() for m in masks])
    both = cp_all_reduce_sum(torch.stack([sums, counts]), ps)
    return list((both[0] / both[1].clamp(min=1.0)).unbind(0))


def gspo_ppo_kl(
    log_probs: Sequence[torch.Tensor],
    old_log_probs: Sequence[torch.Tensor],
    masks: Sequence[torch.Tensor],
    ps: ParallelState | None,
) -> list[torch.Tensor]:
    """GSPO: the sequence-level ppo_kl, mean over the full response of (ℓ_old − ℓ), on every local token.

    e^{−that} is GSPO's ratio s_i = (π/π_old)^{1/|y|}; gradients flow through ℓ of all tokens of the sample.
    """
    diffs = [o.to(lp.dtype) - lp for lp, o in zip(log_probs, old_log_probs, strict=True)]
    means = sequence_masked_means(diffs, masks, ps)
    return [mu.to(lp.dtype).expand(lp.shape[0]) for mu, lp in zip(means, log_probs, strict=True)]


def opsm_keep_masks(
    log_probs: Sequence[torch.Tensor],
    old_log_probs: Sequence[torch.Tensor],
    advantages: Sequence[torch.Tensor],
    masks: Sequence[torch.Tensor],
    delta: float,
    ps: ParallelState | None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """OPSM (`--use-opsm`): (keep, dropped) per-token 0/1 masks.

    A token is dropped when its advantage is negative and its sequence drifted off-policy, i.e. the
    full-response masked mean of (ℓ_old − ℓ) exceeds `delta`: such sequences push probability away from
    samples the current policy no longer produces, which only adds variance.
    """
    with torch.no_grad():
        seq_kl = sequence_masked_means(
            [o.detach() - lp.detach() for lp, o in zip(log_probs, old_log_probs, strict=True)], masks, ps
        )
    keep, dropped = [], []
    for a, m, kl in zip(advantages, masks, seq_kl, strict=True):
        d = ((a < 0) & (kl > delta)).to(a.dtype) * m.to(a.dtype)
        dropped.append(d)
        keep.append(1 - d)
    return keep, dropped


def _tis_ratio(train_log_probs: Sequence[torch.Tensor], rollout_log_probs: Sequence[torch.Tensor]) -> torch.Tensor:
    old = torch.cat([t.detach() for t in train_log_probs]) if train_log_probs else torch.zeros(0)
    roll = torch.cat([t.detach() for t in rollout_log_probs]) if rollout_log_probs else torch.zeros(0)
    dtype = torch.promote_types(torch.promote_types(old.dtype, roll.dtype), torch.float32)
    return torch.exp(old.to(dtype) - roll.to(old.device, dtype))


def vanilla_tis_function(
    args: Any,
    *,
    pg_loss: torch.Tensor,
    train_log_probs: Sequence[torch.Tensor],
    rollout_log_probs: Sequence[torch.Tensor],
    loss_masks: Sequence[torch.Tensor],
    **kwargs: Any,
) -> tuple[torch.Tensor, list[torch.Tensor], dict[str, torch.Tensor]]:
    """Truncated importance sampling: pg_loss · clamp(π_old/μ, tis_clip_low, tis_clip).

    Corrects for the rollout engine's distribution μ differing from the trainer's π_old (kernels, precision)
    while bounding the variance. Metrics: `tis` (the raw ratio), `tis_clipfrac`, `tis_abs` = |ratio − 1|.
    """
    ratio = _tis_ratio(train_log_probs, rollout_log_probs)
    weights = ratio.clamp(min=args.tis_clip_low, max=args.tis_clip)
    metrics = {"tis": ratio, "tis_clipfrac": (weights != ratio).float(), "tis_abs": (ratio - 1).abs()}
    return pg_loss * weights.to(pg_loss.dtype), list(loss_masks), metrics


def icepop_function(
    args: Any,
    *,
    pg_loss: torch.Tensor,
    train_log_probs: Sequence[torch.Tensor],
    rollout_log_probs: Sequence[torch.Tensor],
    loss_masks: Sequence[torch.Tensor],
    **kwargs: Any,
) -> tuple[torch.Tensor, list[torch.Tensor], dict[str, torch.Tensor]]:
    """IcePop: weight by π_old/μ inside [tis_clip_low, tis_clip], zero tokens outside instead of clipping."""
    ratio = _tis_ratio(train_log_probs, rollout_log_probs)
    inside = (ratio >= args.tis_clip_low) & (ratio <= args.tis_clip)
    weights = torch.where(inside, ratio, torch.zeros_like(ratio))
    metrics = {"tis": ratio, "tis_clipfrac": (~inside).float(), "tis_abs": (ratio - 1).abs()}
    return pg_loss * weights.to(pg_loss.dtype), list(loss_masks), metrics
