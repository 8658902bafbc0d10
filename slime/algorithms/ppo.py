"""PPO with a critic: token rewards, GAE as a chunked scan, segment bootstrap across ranks, the clipped value loss.

Conventions (docs/algorithms.md#ppo-and-gae):

- **Values.** V_t is the critic's value of the state *before* response token t (read at the row of the token
  before it, like the log-prob of token t).
- **Token rewards** (`token_rewards`): r_t = −kl_coef · m_t · KL_t, plus the scalar reward R at the last
  *unmasked* response token (on a masked one the mask would erase it).
- **Action tokens only.** Tokens with loss mask 0 inside a response (a tool's or environment's output) are not
  actions: GAE skips them, so the action token before a tool span bootstraps directly from the value of the
  first action token after it (verl 0.9.1's `compute_gae_advantage_return`). Their advantages and returns are 0.
- **GAE** (`gae`, over a sample's action tokens a_1 < … < a_n): δ_i = r_{a_i} + γ·V_{a_{i+1}} − V_{a_i} with
  V := 0 after the last action, A_i = Σ_l (γλ)^l δ_{i+l}, returns G = A + V. `gae` computes it as a chunked scan
  (a [C, C] matrix of (γλ) powers inside each chunk of C tokens, one carry from chunk to chunk, right to left),
  which equals the per-token recursion.
- **Variable-size groups.** The segments of one trajectory (a fan-out group) are *one long sample*: their
  responses are concatenated in batch order, so the last action of a segment bootstraps from the first action's
  value and advantage in the segments after it, and only the last segment's last unmasked token carries the
  trajectory's reward (the rollout side puts it there: `slime.algorithms.advantages.normalize_rewards_from_args`).
  Segments of one group may sit on different micro-batches and DP ranks; each segment's dependence on its
  successors is one affine carry c (its last action gets + c, the action k before it + (γλ)^k·c), so ranks
  exchange one small summary per sample over "dp" and each resolves every chain (`resolve_segment_carries`).
- **Value loss** (`value_loss`): V_clip = V_old + clamp(V − V_old, −ε, ε), loss_t = max((V_clip − G)², (V − G)²)
  (no ½), reduced like every other loss (one token mean per group); `value_clipfrac` counts |V − V_old| > ε.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from slime.algorithms.advantages import gather_response_over_cp
from slime.algorithms.cp_slicing import slice_response_for_cp
from slime.algorithms.kl import compute_approx_kl
from slime.parallel_state import ParallelState

logger = logging.getLogger(__name__)

GAE_CHUNK = 128
F64 = torch.float64


def token_rewards(
    rewards: Sequence[float], kl: Sequence[torch.Tensor], masks: Sequence[torch.Tensor], kl_coef: float
) -> list[torch.Tensor]:
    """Per-token rewards over whole responses: −kl_coef·m_t·KL_t, plus R at the last unmasked token (float64)."""
    out = []
    for r, k, m in zip(rewards, kl, masks, strict=True):
        m = m.to(F64)
        tok = -float(kl_coef) * m * k.to(device=m.device, dtype=F64) if kl_coef else torch.zeros_like(m)
        nz = torch.nonzero(m, as_tuple=True)[0]
        if nz.numel():
            tok[nz[-1]] += float(r)
        out.append(tok)
    return out


def _pad(rows: Sequence[torch.Tensor], width: int) -> torch.Tensor:
    out = torch.zeros(len(rows), width, dtype=F64, device=rows[0].device if rows else None)
    for i, r in enumerate(rows):
        out[i, : r.numel()] = r.to(F64)
    return out


def gae(
    rewards: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    gamma: float,
    lambd: float,
    *,
    chunk: int = GAE_CHUNK,
) -> list[torch.Tensor]:
    """Advantages A_t = Σ_l (γλ)^l δ_{t+l} per sample, with V := 0 after each sample's last token (float64).

    `rewards` and `values` are per-sample tensors over whole responses (already masked). The samples are
    right-padded with zeros into one [B, T] batch (a pad has δ = 0 and nothing after it, so it changes nothing)
    and scanned in chunks: inside a chunk, A = δ @ M with M[j, i] = (γλ)^(j−i) for j ≥ i; from chunk to chunk,
    A_t += (γλ)^(end−t) · A_end, where A_end is the next chunk's first advantage.
    """
    if not rewards:
        return []
    lengths = [int(r.numel()) for r in rewards]
    width = max(max(lengths), 1)
    r = _pad(rewards, width)
    v = _pad(values, width + 1)  # V_T := 0 after the last token
    delta = r + gamma * v[:, 1:] - v[:, :-1]
    w = float(gamma) * float(lambd)
    c = max(1, min(int(chunk), width))
    idx = torch.arange(c, device=delta.device, dtype=F64)
    expo = idx.view(-1, 1) - idx.view(1, -1)  # j - i
    powers = torch.where(expo >= 0, torch.tensor(w, dtype=F64).pow(expo.clamp(min=0)), torch.zeros((), dtype=F64))
    adv = torch.empty_like(delta)
    carry = torch.zeros(delta.size(0), dtype=F64, device=delta.device)  # A at the first token of the next chunk
    for start in range(((width - 1) // c) * c, -1, -c):
        end = min(start + c, width)
        n = end - start
        local = delta[:, start:end] @ powers[:n, :n]
        tail = torch.tensor(w, dtype=F64).pow(torch.arange(n, 0, -1, dtype=F64, device=delta.device))
        adv[:, start:end] = local + carry.view(-1, 1) * tail.view(1, -1)
        carry = adv[:, start]
    return [adv[i, :n] for i, n in enumerate(lengths)]


def resolve_segment_carries(
    first_adv: torch.Tensor, first_value: torch.Tensor, lengths: torch.Tensor, next_pos: torch.Tensor, gamma: float,
    lambd: float,
) -> torch.Tensor:  # fmt: skip
    """The carry c_p of every batch position p: what its last token gets from the segments after it.

    Inputs are per batch position: `first_adv` (A at its first token with zero bootstrap), `first_value` (its
    masked V at the first token), `lengths` (response tokens) and `next_pos` (the next segment of its group in
    batch order, −1 for a last segment; always a later position). Positions are resolved from the last to the
    first, so every successor is final before its predecessor reads it. An empty segment passes its
    successor's head (value, advantage) through, as if it were not there.
    """
    w = float(gamma) * float(lambd)
    n = int(first_adv.numel())
    fa, fv, ln, nx = first_adv.tolist(), first_value.tolist(), [int(x) for x in lengths.tolist()], next_pos.tolist()
    carry = [0.0] * n
    head_v, head_a = [0.0] * n, [0.0] * n
    for p in range(n - 1, -1, -1):
        j = int(nx[p])
        if j >= 0:
            if j <= p:
                raise ValueError(f"segment at batch position {p} has its successor at {j}: successors come later")
            carry[p] = gamma * head_v[j] + w * head_a[j]
        if ln[p] > 0:
            head_v[p] = fv[p]
            head_a[p] = fa[p] + (w ** (ln[p] - 1)) * carry[p]
        elif j >= 0:
            head_v[p], head_a[p] = head_v[j], head_a[j]
    return torch.tensor(carry, dtype=F64)


def apply_carry(adv: torch.Tensor, carry: float, gamma: float, lambd: float) -> torch.Tensor:
    """A_t + (γλ)^(L−1−t) · c: the segment's advantages once its successors' carry c is known."""
    if not carry or adv.numel() == 0:
        return adv
    n = adv.numel()
    expo = torch.arange(n - 1, -1, -1, dtype=F64, device=adv.device)
    return adv + carry * torch.tensor(float(gamma) * float(lambd), dtype=F64).pow(expo).to(adv.device)


def _gather_full(
    parts: Sequence[torch.Tensor], totals: Sequence[int], resps: Sequence[int], ps: ParallelState | None
) -> list[torch.Tensor]:
    return [t.to(F64) for t in gather_response_over_cp(parts, totals, resps, ps)]


def _scatter(x: torch.Tensor, idx: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(like, dtype=F64)
    out[idx] = x.to(device=out.device, dtype=F64)
    return out


def ppo_advantages(
    args: Any, batch: dict[str, Any], ps: ParallelState | None = None, *, kl_coef: float | None = None
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """GAE advantages and returns over action tokens for one rank's samples (CP-local float32 lists), segments
    chained over DP; masked tokens get 0.

    `batch` holds per-sample lists over *all* the rank's samples (not one micro-batch): `rewards`,
    `loss_masks` (full response masks), `total_lengths`, `response_lengths`, `values` (CP-local, the
    critic's old values), `batch_positions` and `next_segments` (from the rollout side), and for KL shaping
    `log_probs` / `ref_log_probs` (CP-local). `kl_coef` defaults to `--kl-coef` (the critic passes 0: its
    returns are those of the task reward, computed before the actor's log-probs exist).
    """
    kl_coef = args.kl_coef if kl_coef is None else kl_coef
    cp_size, cp_rank = (1, 0) if ps is None else (ps.size("cp"), ps.rank("cp"))
    totals, resps = list(batch["total_lengths"]), list(batch["response_lengths"])
    masks = [torch.as_tensor(m).to(F64) for m in batch["loss_masks"]]
    device = masks[0].device if masks else torch.device("cpu")
    values = _gather_full(batch["values"], totals, resps, ps)
    values = [v.to(device) * m for v, m in zip(values, masks, strict=True)]
    if kl_coef:
        log_probs = batch["rollout_log_probs"] if args.use_rollout_logprobs else batch["log_probs"]
        kl_local = [
            compute_approx_kl(lp.detach(), r.detach(), args.kl_loss_type)
            for lp, r in zip(log_probs, batch["ref_log_probs"], strict=True)
        ]
        kl = [k.to(device) for k in _gather_full(kl_local, totals, resps, ps)]
    else:
        kl = [torch.zeros_like(m) for m in masks]
    rewards = token_rewards([float(r) for r in batch["rewards"]], kl, masks, kl_coef)
    # GAE over action tokens only: compress each response to its unmasked tokens, scatter the result back
    actions = [torch.nonzero(m, as_tuple=True)[0] for m in masks]
    act_values = [v[i] for v, i in zip(values, actions, strict=True)]
    act_adv = gae(
        [r[i] for r, i in zip(rewards, actions, strict=True)], act_values, float(args.gamma), float(args.lambd)
    )
    act_adv = _chain_segments(act_adv, act_values, batch, ps, float(args.gamma), float(args.lambd))
    adv = [_scatter(a, i, m) for a, i, m in zip(act_adv, actions, masks, strict=True)]
    returns = [_scatter(a + v, i, m) for a, v, i, m in zip(act_adv, act_values, actions, masks, strict=True)]

    def local(xs: list[torch.Tensor]) -> list[torch.Tensor]:
        return [slice_response_for_cp(x, t, r, cp_size, cp_rank).float() for x, t, r in zip(xs, totals, resps, strict=True)]  # fmt: skip

    return local(adv), local(returns)


def _chain_segments(
    adv: list[torch.Tensor],
    values: list[torch.Tensor],
    batch: dict[str, Any],
    ps: ParallelState | None,
    gamma: float,
    lambd: float,
) -> list[torch.Tensor]:
    """Add each segment's carry from the segments after it (on any DP rank): one all-reduce over "dp"."""
    positions = [int(p) for p in batch["batch_positions"]]
    nexts = [int(n) for n in batch["next_segments"]]
    dp = 1 if ps is None else ps.size("dp")
    size = torch.tensor([max(positions, default=-1) + 1], dtype=F64)
    if dp > 1:
        ps.all_reduce(size, "max", "dp")  # type: ignore[union-attr]
    n = int(size.item())
    summary = torch.zeros(n, 4, dtype=F64)  # first advantage, first value, length, next position + 1
    for p, nx, a, v in zip(positions, nexts, adv, values, strict=True):
        if a.numel():
            summary[p, 0], summary[p, 1] = float(a[0]), float(v[0])
        summary[p, 2], summary[p, 3] = float(a.numel()), float(nx + 1)
    if dp > 1:
        ps.all_reduce(summary, "sum", "dp")  # type: ignore[union-attr]
    if not bool((summary[:, 3] > 0).any()):
        return adv  # every trajectory is one sample: nothing to chain
    carry = resolve_segment_carries(summary[:, 0], summary[:, 1], summary[:, 2], summary[:, 3] - 1, gamma, lambd)
    return [apply_carry(a, float(carry[p]), gamma, lambd) for a, p in zip(adv, positions, strict=True)]


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped value loss max((V_clip − G)², (V − G)²) and the clip indicator |V − V_old| > ε."""
    old = old_values.to(values.dtype)
    ret = returns.to(values.dtype)
    clipped = old + (values - old).clamp(-clip, clip)
    loss = torch.maximum((clipped - ret) ** 2, (values - ret) ** 2)
    clipfrac = ((values.detach() - old).abs() > clip).to(values.dtype)
    return loss, clipfrac


def response_values(output: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
    """Sample values from the critic's per-row output: V_t is read at the row of the token before token t.

    `rows` are the rows of the token before the response and of every response token (`sample_rows(i,
    last=r + 1)`), so the response's r values are the first r of them (the last token's own row predicts
    nothing)."""
    if len(rows) <= 1:
        return output.new_zeros(0)
    return output[torch.as_tensor(list(rows[:-1]), device=output.device)]
