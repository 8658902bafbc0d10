"""Token sampling with SGLang's semantics, as a pure function of logits so it can be unit-tested alone.

Why this matters: the trainer recomputes log-probs as `log_softmax(logits / temperature)` and compares them
with what the engine returned, so the fake must return exactly that quantity — over the FULL vocabulary,
not renormalised after top-p / top-k / min-p truncation (SGLang: python/sglang/srt/layers/sampler.py computes
`logprobs = log_softmax(logits)` after dividing by temperature and before the top-k/top-p filtering).
Temperature 0 means greedy; SGLang then treats it as temperature 1 with top_k 1
(python/sglang/srt/sampling/sampling_params.py: `_SAMPLING_EPS`), so the log-probs are plain `log_softmax(logits)`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

SAMPLING_EPS = 1e-6


def scripted_logprob(token_id: int, position: int) -> float:
    """The log-prob engines without a model report: deterministic, strictly negative, and dependent on both the
    token and its position, so an off-by-one in log-prob alignment shows."""
    return -(0.05 + ((31 * token_id + 17 * position) % 97) / 100.0)


def logprob_temperature(temperature: float) -> float:
    """The temperature log-probs are computed at: 0 (greedy) counts as 1, as in SGLang."""
    return 1.0 if temperature < SAMPLING_EPS else temperature


def filter_probs(probs: torch.Tensor, top_p: float = 1.0, top_k: int = -1, min_p: float = 0.0) -> torch.Tensor:
    """Zero out tokens outside top-k / top-p / min-p and renormalise (1-D `probs`)."""
    probs = probs.clone()
    vocab = probs.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(probs, top_k).values[-1]
        probs[probs < kth] = 0.0
    if top_p < 1.0:
        sorted_p, idx = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_p, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the token that crosses the line stays).
        drop = (cum - sorted_p) > top_p
        sorted_p[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_p)
    if min_p > 0.0:
        probs[probs < min_p * probs.max()] = 0.0
    return probs / probs.sum()


def sample_one(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_p: float = 1.0,
    top_k: int = -1,
    min_p: float = 0.0,
    generator: torch.Generator | None = None,
) -> tuple[int, float]:
    """Sample one token from 1-D fp32 `logits`; return (token_id, logprob) with SGLang's log-prob semantics."""
    return sample_batch(logits[None], [(temperature, top_p, top_k, min_p)], [generator])[0]


def sample_batch(
    logits: torch.Tensor,
    params: Sequence[tuple[float, float, int, float]],
    generators: Sequence[torch.Generator | None],
) -> list[tuple[int, float]]:
    """`sample_one` for every row of `logits` [B, V], row i with `params[i]` = (temperature, top_p, top_k,
    min_p) and its own generator.

    The softmaxes run once over the batch; only the draw is per row, because each request keeps its own
    generator (a fixed `sampling_seed` gives the same tokens whatever the batch). Per-row sampling in Python
    was the largest cost of a CPU rollout of many short answers.
    """
    logits = logits.float()
    greedy = [t < SAMPLING_EPS or k == 1 for t, _, k, _ in params]
    # greedy rows: temperature 0 reads plain log_softmax(logits) (SGLang treats it as temperature 1, top_k 1)
    temps = torch.tensor([1.0 if t < SAMPLING_EPS else t for t, _, _, _ in params], dtype=logits.dtype)
    scaled = logits / temps[:, None]
    logprobs = torch.log_softmax(scaled, dim=-1)
    tokens = torch.argmax(logits, dim=-1).tolist()
    sampled = [i for i, g in enumerate(greedy) if not g]
    if sampled:
        probs = torch.softmax(scaled[sampled], dim=-1)
        for j, i in enumerate(sampled):
            _, top_p, top_k, min_p = params[i]
            row = probs[j]  # multinomial needs no normalised row; filter_probs renormalises what it keeps
            if top_p < 1.0 or top_k > 0 or min_p > 0.0:
                row = filter_probs(row, top_p=top_p, top_k=top_k, min_p=min_p)
            tokens[i] = int(torch.multinomial(row, 1, generator=generators[i]))
    picked = logprobs.gather(-1, torch.tensor(tokens, dtype=torch.long)[:, None])[:, 0].tolist()
    return list(zip(tokens, picked, strict=True))
