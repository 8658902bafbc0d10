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
from slime.utils.cuda_compile import cuda_compiled

logger = logging.getLogger(__name__)


def _tp_size(ps: ParallelState | None) -> int:
    return 1 if ps is None else ps.size("tp")


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return x if temperature == 1.0 else x.div(temperature)


@cuda_compiled
def _row_max(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return _scaled(logits, temperature).amax(dim=-1, keepdim=True)


@cuda_compiled
def _row_sums(
    logits: torch.Tensor, m: torch.Tensor, local: torch.Tensor, in_shard: torch.Tensor, temperature: float,
    with_entropy: bool,
) -> torch.Tensor:  # fmt: skip
    """[sum exp x', x'_target (0 off this shard), (sum exp x' · x')] per row, x' = logits/T - m."""
    x = _scaled(logits, temperature) - m
    e = x.exp()
    picked = x.gather(-1, local.clamp(0, max(x.shape[-1] - 1, 0)).unsqueeze(-1)).squeeze(-1)
    cols = [e.sum(-1), torch.where(in_shard, picked, torch.zeros_like(picked))]
    if with_entropy:
        cols.append((e * x).sum(-1))
    return torch.stack(cols, dim=-1)


@cuda_compiled
def _logits_grad(
    logits: torch.Tensor, local: torch.Tensor, in_shard: torch.Tensor, m: torch.Tensor, s: torch.Tensor,
    big_e: torch.Tensor, g_logp: torch.Tensor, g_entropy: torch.Tensor | None, temperature: float,
) -> torch.Tensor:  # fmt: skip
    """d(Σ g_logp·log p(t) + g_entropy·H)/d logits for these rows, in the logits' dtype."""
    x = _scaled(logits, temperature) - m
    p = x.exp() / s.unsqueeze(-1)
    g = g_logp.unsqueeze(-1)
    target = (torch.arange(x.shape[-1], device=x.device) == local.unsqueeze(-1)) & in_shard.unsqueeze(-1)
    grad = torch.where(target, g, torch.zeros_like(g)) - p * g
    if g_entropy is not None:
        grad = grad - p * (x - big_e.unsqueeze(-1)) * g_entropy.unsqueeze(-1)
    return (grad / temperature).to(logits.dtype)


class _VocabParallelLogProbEntropy(torch.autograd.Function):
    """(log p(target), entropy) per row of vocab-sharded logits, `chunk` rows at a time.

    With x = logits/T, m the global row max, x' = x - m, S = sum_v exp(x'_v), p = exp(x')/S, E = sum_v p x':
        log p(t) = x'_t - log S,        H = log S - E.
    Gradients w.r.t. x on this rank's columns j:
        d log p(t)/dx_j = 1[j == t] - p_j,    dH/dx_j = -p_j (x'_j - E),
    then divided by T for the logits. p is recomputed in backward from the saved logits, m and S, so no
    vocab-sized activation is kept besides the logits themselves. Chunks bound the float32 temporaries of the
    eager formulas (on CUDA each formula is one compiled kernel reading the logits directly); the gradient is
    written chunk by chunk into one tensor (a chunk per autograd call would make autograd build a zero-filled
    full-size gradient per chunk and add them all up).
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
        chunk: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        tp = _tp_size(ps) > 1
        local = targets.long() - vocab_start
        in_shard = (local >= 0) & (local < logits.shape[-1])
        ms, stats = [], []
        for i in range(0, max(logits.shape[0], 1), chunk):
            rows = slice(i, i + chunk)
            m = _row_max(logits[rows], temperature)
            if tp:
                ps.all_reduce(m, "max", "tp")  # type: ignore[union-attr]
            st = _row_sums(logits[rows], m, local[rows], in_shard[rows], temperature, with_entropy)
            if tp:
                ps.all_reduce(st, "sum", "tp")  # type: ignore[union-attr]
            ms.append(m)
            stats.append(st)
        m, st = (torch.cat(x) if len(x) > 1 else x[0] for x in (ms, stats))
        s = st[:, 0]
        log_s = s.log()
        logp = st[:, 1] - log_s
        if with_entropy:
            big_e = st[:, 2] / s
            entropy = log_s - big_e
        else:
            big_e = torch.zeros_like(s)
            entropy = torch.zeros_like(s)
            ctx.mark_non_differentiable(entropy)
        ctx.save_for_backward(logits, local, in_shard, m, s, big_e)
        ctx.temperature, ctx.with_entropy, ctx.chunk = temperature, with_entropy, chunk
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp: torch.Tensor, g_entropy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        logits, local, in_shard, m, s, big_e = ctx.saved_tensors
        g_entropy = g_entropy if ctx.with_entropy else None
        n, chunk = logits.shape[0], ctx.chunk

        def part(rows: slice) -> torch.Tensor:
            g_h = g_entropy[rows] if g_entropy is not None else None
            return _logits_grad(logits[rows], local[rows], in_shard[rows], m[rows], s[rows], big_e[rows],
                                g_logp[rows], g_h, ctx.temperature)  # fmt: skip

        if n <= chunk:
            return part(slice(0, n)), None, None, None, None, None, None
        grad = torch.empty_like(logits)
        for i in range(0, n, chunk):
            grad[i : i + chunk] = part(slice(i, i + chunk))
        return grad, None, None, None, None, None, None


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
    chunk = chunk_size if chunk_size is not None and chunk_size > 0 else max(n, 1)
    return _VocabParallelLogProbEntropy.apply(logits_shard, targets, ps, temperature, vocab_start, with_entropy, chunk)


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
