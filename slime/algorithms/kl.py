"""Per-token KL estimators between the policy and a base policy (reference model or old policy).

Only sampled-token log-probs are available (not full distributions), so KL(π‖π_base) is estimated from
log r = ℓ − ℓ_base with Schulman's estimators (http://joschu.net/blog/kl-approx.html):
k1 = log r (unbiased, high variance, can be negative), k2 = (log r)²/2, k3 = e^{−log r} − 1 + log r
(unbiased and non-negative). `low_var_kl` is k3 clamped to [−10, 10] so one wildly off-policy token cannot
dominate the loss. Used by the KL loss (`--use-kl-loss`, `--kl-loss-type`) and by reward shaping
(`--kl-coef`, REINFORCE++ estimators).
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

KL_TYPES = ("k1", "k2", "k3", "low_var_kl")
LOW_VAR_KL_CLAMP = 10.0


def compute_approx_kl(
    log_probs: torch.Tensor,
    log_probs_base: torch.Tensor,
    kl_type: str,
    importance_ratio: torch.Tensor | None = None,
) -> torch.Tensor:
    """Elementwise KL estimate; `importance_ratio` (e^{ℓ − ℓ_old}, `--use-unbiased-kl`) reweights it.

    As in slime, the ratio multiplies before the low_var_kl clamp, so the clamp bounds the final term.
    Computed in at least float32 (bf16 log-prob differences lose too many digits).
    """
    dtype = torch.promote_types(log_probs.dtype, torch.float32)
    log_ratio = log_probs.to(dtype) - log_probs_base.to(dtype)
    if kl_type == "k1":
        kl = log_ratio
    elif kl_type == "k2":
        kl = log_ratio.square() / 2
    elif kl_type in ("k3", "low_var_kl"):
        rho = -log_ratio
        kl = torch.expm1(rho) - rho  # expm1: no cancellation for small rho, so the estimate stays >= 0
    else:
        raise ValueError(f"unknown KL type {kl_type!r}; expected one of {KL_TYPES}")
    if importance_ratio is not None:
        kl = importance_ratio * kl
    if kl_type == "low_var_kl":
        kl = kl.clamp(-LOW_VAR_KL_CLAMP, LOW_VAR_KL_CLAMP)
    return kl
