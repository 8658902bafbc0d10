"""Per-token log-probs and entropy of `logits / temperature`, with the vocabulary sharded over TP ranks.

Why the temperature: SGLang returns `log_softmax(logits / T)` over the full vocabulary (top-p/top-k do not
renormalise it), so the trainer must score tokens the same way for ratios against rollout log-probs to be
meaningful (docs/sglang_contract.md#log-probs-and-temperature).

Why a hand-written autograd function: on real runs the logits of one position are split over the TP ranks
(rank r holds columns [vocab_start, vocab_start + V/tp)). The forward needs three collectives over "tp"
(max for stability, then one packed sum of [sum exp, target logit, sum exp·logit]); the backward needs none,
because the gradient of a rank's shard depends only on that shard's softmax and the already all-reduced
scalars. So `ParallelState.all_reduce` need not be differentiable. With tp=1 everything equals
`torch.log_softmax` / the full-vocabulary entropy.

Integration (train step): `response_logprobs_and_entropy(logits, tokens, total_lengths, response_lengths, ps,
temperature=args.rollout_temperature, vocab_start=tp_rank * V_local, chunk_size=args.log_probs_chunk_size)`
takes this rank's packed logits ([T_local, V_local], batch dim squeezed) and returns per-sample lists of
response-aligned (CP-local) log-probs and entropies, the inputs of `slime.algorithms.loss.loss_function`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from slime.algorithms.cp_slicing import cp_pad_len, response_ranges_for_cp, zigzag_chunk_ranges
from slime.parallel_state import ParallelState

logger = logging.getLogger(__name__)


def _tp_size(ps: ParallelState | None) -> int:
    return 1 if ps is None else ps.size("tp")


class _VocabParallelLogProbEntropy(torch.autograd.Function):
    """(log p(target), entropy) per row of vocab-sharded logits.

    With x = logits/T, m the global row max, x' = x - m, S = sum_v exp(x'_v), p = exp(x')/S, E = sum_v p x':
        log p(t) = x'_t - log S,        H = log S - E.
    Gradients w.r.t. x on this rank's columns j:
        d log p(t)/dx_j = 1[j == t] - p_j,    dH/dx_j = -p_j (x'_j - E),
    then divided by T for the logits. p is recomputed in backward from the saved logits, m and S, so no
    vocab-sized activation is kept besides the logits themselves.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        logits: torch.Tensor,
        targets: torch.Tensor,
        ps: ParallelState | None,
        temperature: float,
        vocab_start: int,
        with_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = torch.promote_types(logits.dtype, torch.float32)
        tp = _tp_size(ps) > 1
        x = logits.to(dtype).div(temperature)
        m = x.max(dim=-1, keepdim=True).values
        if tp:
            ps.all_reduce(m, "max", "tp")  # type: ignore[union-attr]
        x.sub_(m)
        e = x.exp()
        local = targets.long() - vocab_start
        in_shard = (local >= 0) & (local < x.shape[-1])
        picked = x.gather(-1, local.clamp(0, max(x.shape[-1] - 1, 0)).unsqueeze(-1)).squeeze(-1)
        cols = [e.sum(-1), torch.where(in_shard, picked, torch.zeros_like(picked))]
        if with_entropy:
            cols.append((e * x).sum(-1))
        stats = torch.stack(cols, dim=-1)
        if tp:
            ps.all_reduce(stats, "sum", "tp")  # type: ignore[union-attr]
        s = stats[:, 0]
        log_s = s.log()
        logp = stats[:, 1] - log_s
        if with_entropy:
            big_e = stats[:, 2] / s
            entropy = log_s - big_e
        else:
            big_e = torch.zeros_like(s)
            entropy = torch.zeros_like(s)
            ctx.mark_non_differentiable(entropy)
        ctx.save_for_backward(logits, local, in_shard, m, s, big_e)
        ctx.temperature = temperature
        ctx.with_entropy = with_entropy
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp: torch.Tensor, g_entropy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        logits, local, in_shard, m, s, big_e = ctx.saved_tensors
        x = logits.to(m.dtype).div(ctx.temperature).sub_(m)
        p = x.exp().div_(s.unsqueeze(-1))
        grad = p * (-g_logp.unsqueeze(-1))
        rows = torch.nonzero(in_shard, as_tuple=True)[0]
        grad.index_put_((rows, local[rows]), g_logp[rows], accumulate=True)
        if ctx.with_entropy and g_entropy is not None:
            grad.sub_(p * (x - big_e.unsqueeze(-1)) * g_entropy.unsqueeze(-1))
        grad.div_(ctx.temperature)
        return grad.to(logits.dtype), None, None, None, None, None


def vocab_parallel_logprobs_and_entropy(
    logits_shard: torch.Tensor,
    targets: torch.Tensor,
    ps: ParallelState | None,
    temperature: float = 1.0,
    vocab_start: int = 0,
    *,
    with_entropy: bool = True,
    chunk_size: int = -1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row log p(target) and entropy of `log_softmax(logits / temperature)` over the full vocabulary.

    `logits_shard` is [N, V_local], this TP rank's columns starting at global id `vocab_start`; `targets`
    are global token ids [N]. Every TP rank must call this with the same N (the collectives pair up row
    blocks). `chunk_size` > 0 processes that many rows at a time (`--log-probs-chunk-size`) to bound the
    float32 temporaries. Returns float32 (float64 for float64 input); entropy is zeros when not requested.
    """
    if logits_shard.dim() != 2 or targets.dim() != 1 or targets.shape[0] != logits_shard.shape[0]:
        raise ValueError(
            f"expected logits [N, V] and targets [N], got {tuple(logits_shard.shape)}, {tuple(targets.shape)}"
        )
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    n = logits_shard.shape[0]
    if chunk_size is None or chunk_size <= 0 or n <= chunk_size:
        return _VocabParallelLogProbEntropy.apply(logits_shard, targets, ps, temperature, vocab_start, with_entropy)
    parts = [
        _VocabParallelLogProbEntropy.apply(
            logits_shard[i : i + chunk_size], targets[i : i + chunk_size], ps, temperature, vocab_start, with_entropy
        )
        for i in range(0, n, chunk_size)
    ]
    return torch.cat([lp for lp, _ in parts]), torch.cat([h for _, h in parts])


def response_rows(
    total_lengths: Sequence[int], response_lengths: Sequence[int], cp_size: int, cp_rank: int
) -> list[tuple[list[int], list[tuple[int, int]]]]:
    """For each sample: (local logits rows predicting its CP-local response tokens, their response ranges).

    Layout of this rank's packed logits: with cp_size == 1 the samples lie back to back (`total_lengths`,
    trailing padding allowed); with cp_size > 1 each sample occupies cp_pad_len(total)/cp local positions,
    its two zigzag chunks in order, as `cp_slicing.slice_packed_for_cp` builds them. Logits at position t
    predict token t+1.
    """
    out: list[tuple[list[int], list[tuple[int, int]]]] = []
    base = 0
    for total, resp in zip(total_lengths, response_lengths, strict=True):
        first = total - resp - 1  # position predicting response token 0
        if cp_size == 1:
            ranges = [(0, resp)] if resp > 0 else []
            rows = list(range(base + first, base + first + resp))
            base += total
        else:
            ranges = response_ranges_for_cp(total, resp, cp_size, cp_rank)
            (s0, e0), (s1, _) = zigzag_chunk_ranges(total, cp_size, cp_rank)
            rows = []
            for lo, hi in ranges:
                for j in range(lo, hi):
                    p = first + j
                    rows.append(base + (p - s0 if s0 <= p < e0 else (e0 - s0) + p - s1))
            base += cp_pad_len(total, cp_size) // cp_size
        out.append((rows, ranges))
    return out


def response_logprobs_and_entropy(
    logits: torch.Tensor,
    tokens: Sequence[torch.Tensor],
    total_lengths: Sequence[int],
    response_lengths: Sequence[int],
    ps: ParallelState | None,
    *,
    temperature: float = 1.0,
    vocab_start: int = 0,
    with_entropy: bool = True,
    chunk_size: int = -1,
    vocab_parallel: bool = True,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-sample CP-local response log-probs and entropies from this rank's packed logits [T_local, V_local].

    `tokens[i]` is sample i's full (unsliced) prompt+response token ids. One autograd call covers the whole
    micro-batch; results are split back per sample, each aligned with `cp_slicing.slice_response_for_cp`.
    `vocab_parallel=False` when the logits already hold the full vocabulary (gathered over TP): then no TP
    collective runs, which would otherwise count every column tp times.
    """
    if logits.dim() == 3 and logits.shape[0] == 1:
        logits = logits.squeeze(0)
    cp_size = 1 if ps is None else ps.size("cp")
    cp_rank = 0 if ps is None else ps.rank("cp")
    layout = response_rows(total_lengths, response_lengths, cp_size, cp_rank)
    rows: list[int] = []
    targets: list[torch.Tensor] = []
    sizes: list[int] = []
    for (r, ranges), tok, total, resp in zip(layout, tokens, total_lengths, response_lengths, strict=True):
        if tok.shape[0] != total:
            raise ValueError(f"sample has {tok.shape[0]} tokens but total_length {total}")
        rows += r
        prompt = total - resp
        targets += [tok[prompt + lo : prompt + hi] for lo, hi in ranges]
        sizes.append(len(r))
    tgt = torch.cat(targets).to(logits.device) if targets else torch.empty(0, dtype=torch.long, device=logits.device)
    return score_rows(
        logits,
        rows,
        tgt,
        sizes,
        ps if vocab_parallel else None,
        temperature=temperature,
        vocab_start=vocab_start if vocab_parallel else 0,
        with_entropy=with_entropy,
        chunk_size=chunk_size,
    )


def score_rows(
    logits: torch.Tensor,
    rows: list[int] | torch.Tensor,
    targets: torch.Tensor,
    sizes: list[int],
    ps: ParallelState | None,
    *,
    temperature: float,
    vocab_start: int,
    with_entropy: bool,
    chunk_size: int,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Score logits `rows` against `targets` in one call, split per sample (`sizes`): the shared tail of the
    readers here and of the trainer's context-parallel reader (backends/megatron/context_parallel.py)."""
    idx = torch.as_tensor(rows, dtype=torch.long).to(logits.device)
    logp, ent = vocab_parallel_logprobs_and_entropy(
        logits.index_select(0, idx),
        targets,
        ps,
        temperature,
        vocab_start,
        with_entropy=with_entropy,
        chunk_size=chunk_size,
    )
    return list(logp.split(sizes)), list(ent.split(sizes))


def packed_response_logprobs_and_entropy(
    logits: torch.Tensor,
    row_tokens: torch.Tensor,
    sample_rows: Sequence[Sequence[int]],
    response_lengths: Sequence[int],
    ps: ParallelState | None,
    *,
    temperature: float = 1.0,
    vocab_start: int = 0,
    with_entropy: bool = True,
    chunk_size: int = -1,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """`response_logprobs_and_entropy` for a packed row whose samples need not lie back to back (cp == 1).

    `sample_rows[i]` is the row of each of sample i's tokens in `logits` [T, V_local] and `row_tokens` [T]
    (`packing.PackedBatch.sample_rows`): with shared prompts a sample's prompt rows are its siblings' too.
    Targets are read from the row itself, so the whole micro-batch costs two gathers, not a slice per sample.
    """
    if logits.dim() == 3 and logits.shape[0] == 1:
        logits = logits.squeeze(0)
    if ps is not None and ps.size("cp") != 1:
        raise ValueError("packed_response_logprobs_and_entropy needs cp_size 1 (CP slices samples instead)")
    pred: list[int] = []
    target: list[int] = []
    for rows, resp in zip(sample_rows, response_lengths, strict=True):
        total = len(rows)
        if not 0 <= resp < max(total, 1):
            raise ValueError(f"response length {resp} needs a prompt token before it ({total} tokens)")
        pred += rows[total - resp - 1 : total - 1]
        target += rows[total - resp : total]
    dev = logits.device
    targets = row_tokens.reshape(-1).to(dev).index_select(0, torch.tensor(target, dtype=torch.long, device=dev))
    return score_rows(
        logits,
        pred,
        targets,
        list(response_lengths),
        ps,
        temperature=temperature,
        vocab_start=vocab_start,
        with_entropy=with_entropy,
        chunk_size=chunk_size,
    )
