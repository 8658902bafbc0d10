"""Reward normalisation for GRPO / GSPO / REINFORCE++-baseline, by prompt index, over trajectories.

slime v0.3.0 reshapes the flat reward list into (-1, n_samples_per_prompt) blocks and, when fan-out changes
the length, silently treats the whole batch as one group. Here statistics are always keyed by the
prompt index `group_index`, and each trajectory (`group_id`) counts once however many segments it fanned
out into: a trajectory split in K segments must not weigh K times in its prompt's mean and std. Every
segment then inherits its trajectory's normalised reward, which is its advantage for GRPO/GSPO.

Trainer side, `compute_advantages_and_returns(args, batch, ps)` turns those per-sample rewards into per-token
advantages (docs/algorithms.md). Its `batch` holds per-sample lists: `rewards` (the post-processed rewards above),
`loss_masks` (the *full* response masks, as on the rollout side), `total_lengths`, `response_lengths`, and
CP-local `log_probs` / `rollout_log_probs` / `ref_log_probs` (each rank's `slice_response_for_cp` part). It
writes `kl`, `advantages`, `returns` back (CP-local lists). REINFORCE++ needs whole responses for its
discounted returns, so KL parts are combined over "cp" first; whitening (`--normalize-advantages`) uses
statistics over all response tokens of the dp×cp group.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from slime.algorithms.cp_slicing import response_ranges_for_cp, slice_response_for_cp
from slime.algorithms.kl import compute_approx_kl
from slime.algorithms.opd import apply_opd
from slime.parallel_state import ParallelState
from slime.utils.misc import load_function

logger = logging.getLogger(__name__)

_NORMALISED_ESTIMATORS = ("grpo", "gspo", "reinforce_plus_plus_baseline")


def trajectory_rewards(
    rewards: Sequence[float], group_ids: Sequence[int], *, segment_reward: str = "full"
) -> dict[int, float]:
    """One reward per trajectory: segments carry it whole (`full`: their mean) or in K shares (`split`: sum)."""
    if segment_reward not in ("full", "split"):
        raise ValueError(f"segment_reward must be 'full' or 'split', got {segment_reward!r}")
    total: dict[int, float] = {}
    count: dict[int, int] = {}
    for r, g in zip(rewards, group_ids, strict=True):
        total[g] = total.get(g, 0.0) + float(r)
        count[g] = count.get(g, 0) + 1
    if segment_reward == "split":
        return total
    return {g: total[g] / count[g] for g in total}


def normalize_rewards_by_prompt(
    rewards: Sequence[float],
    group_indices: Sequence[int],
    group_ids: Sequence[int],
    *,
    std_normalization: bool = True,
    eps: float = 1e-6,
    segment_reward: str = "full",
) -> list[float]:
    """Per-sample (R_traj - mean_prompt) [/ (std_prompt + eps)], statistics over the prompt's trajectories.

    std is torch's unbiased estimator, as in slime; a prompt with a single trajectory has no spread and gets
    std 0 (so its advantage is 0) instead of NaN. Returns float64 values as a list aligned with `rewards`.
    """
    n = len(rewards)
    if not (len(group_indices) == len(group_ids) == n):
        raise ValueError(f"{n} rewards, {len(group_indices)} group_indices, {len(group_ids)} group_ids")
    if n == 0:
        return []
    traj_reward = trajectory_rewards(rewards, group_ids, segment_reward=segment_reward)
    traj_prompt: dict[int, int] = {}
    for g, p in zip(group_ids, group_indices, strict=True):
        if traj_prompt.setdefault(g, p) != p:
            raise ValueError(f"trajectory {g} has segments with different prompt indices ({traj_prompt[g]} and {p})")
    trajs = list(traj_reward)
    prompts = sorted(set(traj_prompt.values()))
    prompt_pos = {p: j for j, p in enumerate(prompts)}
    r = torch.tensor([traj_reward[g] for g in trajs], dtype=torch.float64)
    pid = torch.tensor([prompt_pos[traj_prompt[g]] for g in trajs], dtype=torch.long)
    k = len(prompts)
    cnt = torch.zeros(k, dtype=torch.float64).index_add_(0, pid, torch.ones_like(r))
    mean = torch.zeros(k, dtype=torch.float64).index_add_(0, pid, r) / cnt
    centred = r - mean[pid]
    if std_normalization:
        ss = torch.zeros(k, dtype=torch.float64).index_add_(0, pid, centred * centred)
        std = torch.where(cnt > 1, (ss / (cnt - 1).clamp(min=1)).sqrt(), torch.zeros_like(ss))
        centred = centred / (std[pid] + eps)
    by_traj = dict(zip(trajs, centred.tolist(), strict=True))
    return [by_traj[g] for g in group_ids]


def reinforce_plus_plus_baseline_rewards(
    rewards: Sequence[float], group_indices: Sequence[int], group_ids: Sequence[int], *, segment_reward: str = "full"
) -> list[float]:
    """REINFORCE++-baseline: subtract the prompt's mean trajectory reward (no std division)."""
    return normalize_rewards_by_prompt(
        rewards, group_indices, group_ids, std_normalization=False, segment_reward=segment_reward
    )


def normalize_rewards_from_args(args: Any, samples: Sequence[Any]) -> list[float]:
    """The rollout-side reward post-processing of slime, keyed by prompt index (`Sample.group_index`)."""
    raw = [s.get_reward_value(args) for s in samples]
    if args.advantage_estimator == "ppo":
        return last_segment_rewards(raw, [s.train_group_id for s in samples], segment_reward=args.fan_out_reward)
    if args.advantage_estimator not in _NORMALISED_ESTIMATORS or args.disable_rewards_normalization:
        return raw
    std = (
        args.advantage_estimator in ("grpo", "gspo")
        and not args.disable_grpo_std_normalization
        and args.n_samples_per_prompt > 1
    )
    group_ids = [s.train_group_id for s in samples]
    return normalize_rewards_by_prompt(
        raw,
        [s.group_index for s in samples],
        group_ids,
        std_normalization=std,
        segment_reward=args.fan_out_reward,
    )


def last_segment_rewards(
    rewards: Sequence[float], group_ids: Sequence[int], *, segment_reward: str = "full"
) -> list[float]:
    """PPO: the trajectory's reward on its last segment (in batch order), 0 on its other segments.

    GAE treats a fan-out group as one long sample (slime/algorithms/ppo.py), so the reward belongs once at the
    end of the whole trajectory; giving every segment its own would count a `full` reward K times. A one-sample
    trajectory keeps its reward unchanged.
    """
    traj = trajectory_rewards(rewards, group_ids, segment_reward=segment_reward)
    last = {g: i for i, g in enumerate(group_ids)}
    return [traj[g] if last[g] == i else 0.0 for i, g in enumerate(group_ids)]


def expand_to_tokens(
    values: Sequence[float], response_lengths: Sequence[int], *, dtype: torch.dtype = torch.float32
) -> list[torch.Tensor]:
    """GRPO/GSPO advantages: each sample's normalised reward on every one of its response tokens."""
    return [torch.full((n,), float(v), dtype=dtype) for v, n in zip(values, response_lengths, strict=True)]


def _cp(ps: ParallelState | None) -> tuple[int, int]:
    return (1, 0) if ps is None else (ps.size("cp"), ps.rank("cp"))


def gather_response_over_cp(
    parts: Sequence[torch.Tensor],
    total_lengths: Sequence[int],
    response_lengths: Sequence[int],
    ps: ParallelState | None,
) -> list[torch.Tensor]:
    """Whole responses from each rank's CP-local parts: scatter into zeros, one sum all-reduce over "cp".

    A sum (not an all-gather) because CP ranks hold parts of different lengths; the parts partition the
    response, so the sum is exact. No gradient (advantages are constants of the loss).
    """
    cp_size, cp_rank = _cp(ps)
    if cp_size == 1:
        return [p.detach() for p in parts]
    full = []
    for p, total, resp in zip(parts, total_lengths, response_lengths, strict=True):
        buf = torch.zeros(resp, dtype=torch.float64)
        off = 0
        for lo, hi in response_ranges_for_cp(total, resp, cp_size, cp_rank):
            buf[lo:hi] = p.detach()[off : off + hi - lo].double()
            off += hi - lo
        full.append(buf)
    flat = torch.cat(full) if full else torch.zeros(0, dtype=torch.float64)
    ps.all_reduce(flat, "sum", "cp")  # type: ignore[union-attr]
    return list(flat.split(list(response_lengths)))


def reinforce_plus_plus_returns(
    rewards: Sequence[float], kl: Sequence[torch.Tensor], masks: Sequence[torch.Tensor], kl_coef: float, gamma: float
) -> list[torch.Tensor]:
    """Discounted returns over whole responses: r_t = −kl_coef·m_t·KL_t, + R at the last unmasked token.

    G_t = r_t + γ·G_{t+1}. A fully masked response gets no reward token (it contributes nothing to the loss).
    """
    out = []
    for r, k, m in zip(rewards, kl, masks, strict=True):
        m = m.to(torch.float64)
        token_r = -kl_coef * m * k.to(torch.float64)
        nz = torch.nonzero(m, as_tuple=True)[0]
        if nz.numel():
            token_r[nz[-1]] += float(r)
        step = token_r.tolist()
        running = 0.0
        for t in range(len(step) - 1, -1, -1):  # a reverse scan: γ^-t rescaling would overflow on long responses
            running = step[t] + gamma * running
            step[t] = running
        out.append(torch.tensor(step, dtype=torch.float64))
    return out


def distributed_masked_whiten(
    values: Sequence[torch.Tensor],
    masks: Sequence[torch.Tensor],
    ps: ParallelState | None,
    *,
    dim: str = "dp_cp",
    eps: float = 1e-8,
) -> list[torch.Tensor]:
    """(v − mean)/sqrt(var + eps) with mean and unbiased var over masked tokens of every rank of `dim`.

    The group is dp×cp, not dp (fixed upstream after v0.3.0, THUDM/slime#2235): CP ranks hold disjoint token sets, so
    leaving them out would whiten each CP part with different statistics. Statistics in float64.
    """
    if not values:
        vals, msk = torch.zeros(0, dtype=torch.float64), torch.zeros(0, dtype=torch.float64)
    else:
        vals = torch.cat([v.detach().double() for v in values])
        msk = torch.cat([m.double() for m in masks])
    if vals.shape != msk.shape:
        raise ValueError(f"advantages cover {vals.shape[0]} tokens but masks {msk.shape[0]}")
    stats = torch.stack([(vals * msk).sum(), (vals * vals * msk).sum(), msk.sum()])
    if ps is not None:
        ps.all_reduce(stats, "sum", dim)  # type: ignore[arg-type]
    s, ss, n = stats.tolist()
    if n == 0:
        logger.warning("normalize-advantages: no unmasked response token on any rank; advantages left as is")
        return [v.clone() for v in values]
    mean = s / n
    var = max(ss / n - mean * mean, 0.0)
    if n >= 2:
        var *= n / (n - 1)
    out = (vals - mean) / (var + eps) ** 0.5
    return [t.to(v.dtype) for t, v in zip(out.split([v.shape[0] for v in values]), values, strict=True)]


def opd_inputs(args: Any, batch: dict[str, Any]) -> tuple[list[torch.Tensor], list[Any]]:
    """(student, teacher) log-probs for OPD: the student's are π_old (the rollout's under --use-rollout-logprobs)."""
    student = batch.get("rollout_log_probs") if args.use_rollout_logprobs else batch.get("log_probs")
    teacher = batch.get("teacher_log_probs")
    if student is None or teacher is None:
        raise ValueError(
            "--use-opd needs the student's log-probs and batch['teacher_log_probs'] (from --opd-teacher-models with "
            "--opd-type sglang, or the --opd-teacher-load forward with --opd-type megatron)"
        )
    return list(student), list(teacher)


def compute_advantages_and_returns(
    args: Any, batch: dict[str, Any], ps: ParallelState | None = None
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-token CP-local advantages and returns for `--advantage-estimator`, written into `batch`.

    KL for reward shaping uses `--kl-loss-type` between ℓ (rollout log-probs under `--use-rollout-logprobs`)
    and ℓ_ref, and is zero when `--kl-coef` is 0 (no reference pass then). `--use-opd` then subtracts
    `--opd-kl-coef`·(ℓ − ℓ_teacher) per token (slime/algorithms/opd.py), before `--normalize-advantages`.
    """
    cp_size, cp_rank = _cp(ps)
    totals = list(batch["total_lengths"])
    resps = list(batch["response_lengths"])
    full_masks = [torch.as_tensor(m) for m in batch["loss_masks"]]
    device = full_masks[0].device if full_masks else torch.device("cpu")  # outputs live where the masks do
    local_len = [
        sum(hi - lo for lo, hi in response_ranges_for_cp(t, r, cp_size, cp_rank))
        for t, r in zip(totals, resps, strict=True)
    ]
    kl_coef = args.kl_coef
    log_probs = batch.get("rollout_log_probs") if args.use_rollout_logprobs else batch.get("log_probs")
    if kl_coef and log_probs:
        ref = batch["ref_log_probs"]
        kl_type = args.kl_loss_type
        kl = [
            compute_approx_kl(lp.detach(), r.detach(), kl_type).float() for lp, r in zip(log_probs, ref, strict=True)
        ]
    else:
        kl = [torch.zeros(n, dtype=torch.float32, device=device) for n in local_len]
    batch["kl"] = kl

    estimator = args.advantage_estimator
    rewards = [float(r) for r in batch["rewards"]]
    if args.custom_advantage_function_path:
        load_function(args.custom_advantage_function_path)(args, batch)
        advantages, returns = list(batch["advantages"]), list(batch["returns"])
    elif estimator in ("grpo", "gspo"):
        advantages = [
            torch.full((n,), r, dtype=torch.float32, device=device) for r, n in zip(rewards, local_len, strict=True)
        ]
        returns = advantages
    elif estimator == "reinforce_plus_plus":
        full_kl = gather_response_over_cp(kl, totals, resps, ps)
        full_ret = reinforce_plus_plus_returns(rewards, full_kl, full_masks, kl_coef, float(args.gamma))
        advantages = [
            slice_response_for_cp(g, t, r, cp_size, cp_rank).float()
            for g, t, r in zip(full_ret, totals, resps, strict=True)
        ]
        returns = advantages
    elif estimator == "reinforce_plus_plus_baseline":
        advantages = [r - kl_coef * k for r, k in zip(rewards, kl, strict=True)]
        returns = advantages
    elif estimator == "ppo":
        # GAE chains a group's segments across micro-batches and ranks: it needs the rank's whole data at once
        raise ValueError("ppo advantages are computed over the rank's whole data: slime.algorithms.ppo.ppo_advantages")
    else:
        raise ValueError(f"unknown advantage estimator {estimator!r}")

    advantages = [a.to(device) for a in advantages]
    returns = [r.to(device) for r in returns]
    if args.use_opd:
        advantages = apply_opd(advantages, *opd_inputs(args, batch), args.opd_kl_coef)
    if args.normalize_advantages:
        local_masks = [
            slice_response_for_cp(m, t, r, cp_size, cp_rank) for m, t, r in zip(full_masks, totals, resps, strict=True)
        ]
        advantages = distributed_masked_whiten(advantages, local_masks, ps)
    batch["advantages"] = advantages
    batch["returns"] = returns
    return advantages, returns
