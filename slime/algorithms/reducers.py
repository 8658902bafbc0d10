"""The per-group token-mean reducer and the scaling chain that makes Megatron produce the step loss.

Target, for one optimizer step s with b groups (default mode; docs/algorithms.md#loss-normalisation):

    L_s = (1/b) * sum_g [ sum_{i in g, t} m_it x_it ] / max(D_g, 1),      D_g = sum_{i in g, t} m_it

i.e. each group is one token mean over all its segments (as if it were one long sample), groups weigh 1/b.
The trainer gets there in three stages, and each stage undoes one thing Megatron does:

1. per micro-batch, on each (dp, cp) rank: R_mb = sum_{i in mb} (sum_{t local} m x) / max(D_g(i), 1), with
   the *global* D_g precomputed on the rollout side, so CP chunks and DP shards of one group add up exactly
   (`sum_of_group_mean`);
2. pre-scale: R_mb * num_microbatches / b * (dp*cp), with num_tokens = 1 (`scale_for_megatron`);
3. Megatron divides by num_microbatches (pipeline_parallel/schedules.py: forward_step_calc_loss), gradients
   accumulate over micro-batches, and DDP averages them over the dp×cp group
   (distributed/distributed_data_parallel.py: gradient_scaling_factor = 1/dp_cp size).

(1/num_mb) * num_mb/b * dp*cp / (dp*cp) = 1/b: the sum over all ranks and micro-batches of R_mb / b is L_s.

Per-token mode (`--calculate-per-token-loss`): R_mb = sum m x (no denominator), the loss is multiplied by cp
and Megatron receives num_tokens = sum_i max(D_i, 1) over the micro-batch's samples (global per-sample
totals, so every CP rank reports the same count). Megatron does not divide by num_microbatches, DDP sums
gradients, and finalize_model_grads divides them by the dp×cp all-reduced token count (cp × the true count,
which the ×cp cancels): L_s = sum m x / sum_i max(D_i, 1).

Metrics use the same sums and denominators (`reduce_train_metrics`), and `rollout_group_mean` computes the
same quantity on the rollout side, so rollout and train logs agree.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence

import torch

from slime.parallel_state import ParallelState

logger = logging.getLogger(__name__)

Reducer = Callable[[Sequence[torch.Tensor] | torch.Tensor], torch.Tensor]


def _token_weights(
    masks: Sequence[torch.Tensor], group_denoms: Sequence[float], per_token: bool, like: torch.Tensor
) -> torch.Tensor:
    """m_it / max(D_g(i), 1) for every token of the micro-batch, concatenated (m_it alone with `per_token`)."""
    if not masks:
        return like.new_zeros(0)
    return torch.cat(
        [
            m.to(like.device, like.dtype).reshape(-1) / (1.0 if per_token else max(float(d), 1.0))
            for m, d in zip(masks, group_denoms, strict=True)
        ]
    )


def _check_sizes(values: Sequence[torch.Tensor], masks: Sequence[torch.Tensor], denoms: Sequence[float]) -> None:
    if not (len(values) == len(masks) == len(denoms)):
        raise ValueError(f"{len(values)} value tensors, {len(masks)} masks, {len(denoms)} denominators")
    if [v.numel() for v in values] != [m.numel() for m in masks]:
        raise ValueError("every value tensor must have one entry per token of its mask")


def sum_of_group_mean(
    values: Sequence[torch.Tensor],
    masks: Sequence[torch.Tensor],
    group_denoms: Sequence[float],
    *,
    per_token: bool = False,
) -> torch.Tensor:
    """R_mb: per sample, the masked sum of its (local) tokens divided by its group's global token total.

    `values[i]`/`masks[i]` are the tokens of sample i this rank holds (all of them, or its CP chunks);
    `group_denoms[i]` is D_{g(i)} over the whole group. A zero D_g (a fully masked group) counts as 1 so the
    group contributes 0 instead of NaN. With `per_token` the denominator is dropped (see module docstring).
    One weighted sum over the concatenated tokens: a micro-batch holds hundreds of samples, and a loop over
    them cost more than the model's forward on short RL samples.
    """
    return make_reducer(masks, group_denoms, per_token=per_token)(values)


def make_reducer(masks: Sequence[torch.Tensor], group_denoms: Sequence[float], *, per_token: bool = False) -> Reducer:
    """Bind one micro-batch's masks and denominators; the loss applies it to pg loss, entropy, KL alike.

    TIS/RS functions that change masks pass their modified masks here; denominators stay the original group
    totals D_g, so a token masked out afterwards lowers the group mean instead of re-weighting it.
    The token weights are built once per micro-batch and reused by every reduction of the loss. The reducer
    takes per-sample tensors or their concatenation (one tensor over the micro-batch's tokens, sample order).
    """
    masks = list(masks)
    denoms = list(group_denoms)
    cache: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def reduce(values: Sequence[torch.Tensor] | torch.Tensor) -> torch.Tensor:
        if isinstance(values, torch.Tensor):  # already the micro-batch's tokens, concatenated in sample order
            flat = values.reshape(-1)
        else:
            _check_sizes(values, masks, denoms)
            if not values:
                return torch.zeros(())
            flat = torch.cat([v.reshape(-1) for v in values])
        key = (flat.dtype, flat.device)
        if key not in cache:
            cache[key] = _token_weights(masks, denoms, per_token, flat)
        if cache[key].numel() != flat.numel():
            raise ValueError(f"{flat.numel()} values for {cache[key].numel()} masked tokens")
        return (flat * cache[key]).sum()

    return reduce


def scale_for_megatron(
    loss: torch.Tensor,
    *,
    num_microbatches: int,
    global_batch_size: int,
    dp_cp_size: int,
    cp_size: int,
    per_token: bool = False,
    sample_token_counts: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 2 of the chain: the (loss, num_tokens) pair a Megatron loss function returns.

    `global_batch_size` is this step's b (smaller for a partial last step, which is how its loss gets 1/b);
    `num_microbatches` is this rank's count in the step. `sample_token_counts` (per-token mode only) are the
    micro-batch's per-sample global mask totals D_i.
    """
    if per_token:
        if sample_token_counts is None:
            raise ValueError("per-token loss needs sample_token_counts (global mask totals of the micro-batch)")
        num_tokens = sum(max(int(n), 1) for n in sample_token_counts)
        return loss * cp_size, torch.tensor(num_tokens, dtype=torch.int)
    if global_batch_size <= 0:
        raise ValueError(f"global_batch_size must be positive, got {global_batch_size}")
    return loss * (num_microbatches * dp_cp_size / global_batch_size), torch.tensor(1, dtype=torch.int)


def reduce_train_metrics(
    local_sums: Mapping[str, torch.Tensor | float],
    ps: ParallelState,
    *,
    global_batch_size: int,
    per_token: bool = False,
    local_num_tokens: float = 0.0,
) -> dict[str, float]:
    """Step metrics from each rank's sum over its micro-batches of R_mb (unscaled reducer outputs).

    Sums are all-reduced over dp×cp (CP partial sums of one sample add up), then divided by b, or in per-token
    mode by the true token count: the all-reduced `local_num_tokens` (sum of `scale_for_megatron`'s counts)
    over cp, since every CP rank reports the same per-sample totals.
    """
    names = sorted(local_sums)
    buf = torch.tensor([float(local_sums[k]) for k in names] + [float(local_num_tokens)], dtype=torch.float64)
    ps.all_reduce(buf, "sum", "dp_cp")
    if per_token:
        denom = max(buf[-1].item() / ps.size("cp"), 1.0)
    else:
        denom = float(global_batch_size)
    return {k: buf[j].item() / denom for j, k in enumerate(names)}


def rollout_group_mean(
    values: Sequence[Sequence[float]], masks: Sequence[Sequence[int]], group_ids: Sequence[int]
) -> tuple[float, int]:
    """(sum over groups of the group token mean, number of groups): the rollout-side twin of the train metric.

    Returned as a (sum, count) pair so several batches or ranks can be merged before dividing.
    """
    num: dict[int, float] = {}
    den: dict[int, float] = {}
    for v, m, g in zip(values, masks, group_ids, strict=True):
        num[g] = num.get(g, 0.0) + sum(float(a) * float(b) for a, b in zip(v, m, strict=True))
        den[g] = den.get(g, 0.0) + float(sum(m))
    return sum(num[g] / max(den[g], 1.0) for g in num), len(num)
