"""Log-probs of finished responses under other models of `--sglang-config`: OPD teachers and the reference policy.

A model scores a response with one prefill and no decoding: `/generate` with `max_new_tokens: 0`,
`return_logprob` and `logprob_start_len = prompt_len - 1` (SGLang 0.5.23, python/sglang/srt/managers/io_struct.py
`GenerateReqInput`). The answer's `meta_info.input_token_logprobs` then holds one `[logprob, token_id, text]` per
token from the last prompt token on; SGLang pads the first log-prob with None (scheduler_output_processor_mixin.py
`add_input_logprob_return_values`), so the rest are exactly the response tokens' log-probs. The last prompt token is
included, not the first response token, because that padded entry would otherwise hide the first response token.

Scoring runs at `--rollout-temperature` (SGLang divides the logits by the request's temperature, 0 counting as 1),
the temperature the trainer divides the student's logits by, so a teacher identical to the student contributes
exactly nothing. One batched request per (group, model) goes through that model's router.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from slime.rollout.model_urls import get_model_url
from slime.utils.http_utils import post_json
from slime.utils.types import Sample, Status

logger = logging.getLogger(__name__)


class ModelScoringError(RuntimeError):
    """A model of --sglang-config could not score a response (unreachable, refused, or a malformed answer)."""


def _start(sample: Sample) -> int:
    return len(sample.tokens) - sample.response_length - 1


def scoring_request(samples: Sequence[Sample], temperature: float) -> dict[str, Any]:
    """The batched `/generate` body that scores the response tokens of samples that share a prompt length.

    One `logprob_start_len` for the batch: SGLang takes a list there, but sglang-router 0.3.2 parses the field as
    one integer (HTTP 422 otherwise), so callers batch the samples of one start together (`score_responses`)."""
    starts = {_start(s) for s in samples}
    if len(starts) != 1:
        raise ValueError(f"one scoring request covers one prompt length; got starts {sorted(starts)}")
    return {
        "input_ids": [list(s.tokens) for s in samples],
        "sampling_params": {"max_new_tokens": 0, "temperature": float(temperature)},
        "return_logprob": True,
        "logprob_start_len": starts.pop(),
    }


def response_log_probs(answer: dict[str, Any], sample: Sample) -> list[float]:
    """The response tokens' log-probs from one scoring answer, checked against the sample's tokens."""
    items = (answer.get("meta_info") or {}).get("input_token_logprobs")
    n = sample.response_length
    expected = list(sample.tokens[len(sample.tokens) - n - 1 :])
    if not isinstance(items, list) or [int(it[1]) for it in items] != expected:
        got = "none" if not isinstance(items, list) else f"{len(items)} entries"
        raise ModelScoringError(
            f"sample {sample.index}: input_token_logprobs ({got}) do not cover its last prompt token and its "
            f"{n} response tokens"
        )
    return [float(it[0]) for it in items[1:]]


async def score_responses(args: Any, model: str, samples: Sequence[Sample]) -> list[list[float]]:
    """Per sample, the log-prob of every response token under `model` (one request for all of them)."""
    todo = [s for s in samples if s.response_length > 0]
    if not todo:
        return [[] for _ in samples]
    if any(len(s.tokens) <= s.response_length for s in todo):
        raise ModelScoringError(f"{model}: a sample has no prompt token before its response; nothing to condition on")
    url = get_model_url(args, model, "/generate")
    by_start: dict[int, list[Sample]] = {}
    for s in todo:  # the samples of one prompt share its length: usually one request per group
        by_start.setdefault(_start(s), []).append(s)

    async def one(batch: list[Sample]) -> list[list[float]]:
        try:
            answers = await post_json(url, scoring_request(batch, args.rollout_temperature))
        except RuntimeError as e:
            raise ModelScoringError(f"scoring {len(batch)} response(s) on model {model!r} ({url}) failed: {e}") from e
        if not isinstance(answers, list) or len(answers) != len(batch):
            raise ModelScoringError(f"model {model!r} answered {type(answers).__name__} for {len(batch)} prompts")
        return [response_log_probs(a, s) for s, a in zip(batch, answers, strict=True)]

    batches = list(by_start.values())
    scored = {}
    for batch, lps in zip(batches, await asyncio.gather(*(one(b) for b in batches)), strict=True):
        scored.update({id(s): lp for s, lp in zip(batch, lps, strict=True)})
    return [scored.get(id(s), []) for s in samples]


def mean_log_probs(per_model: Sequence[Sequence[float]]) -> list[float]:
    """Several teachers: the per-token mean of their log-probs, so the OPD term is the mean of the per-teacher
    terms (each teacher pulls with weight 1/K; with one teacher this is that teacher)."""
    k = len(per_model)
    return [sum(col) / k for col in zip(*per_model, strict=True)]


async def attach_model_log_probs(args: Any, samples: Sequence[Sample]) -> None:
    """Fill `teacher_log_probs` (--use-opd --opd-type sglang) and `ref_log_probs` (--ref-model-name) of every
    finished sample. Aborted samples are left alone: they are scored once they finish."""
    teachers = list(args.opd_teacher_models) if args.use_opd and args.opd_type == "sglang" else []
    ref = args.ref_model_name
    models = list(dict.fromkeys(teachers + ([ref] if ref else [])))  # a model that is both is asked once
    finished = [s for s in samples if s.status in (Status.COMPLETED, Status.TRUNCATED)]
    # a finished sample of a group resumed from the buffer keeps its scores (regenerating one clears them)
    done = [s for s in finished if (teachers and s.teacher_log_probs is None) or (ref and s.ref_log_probs is None)]
    if not done or not models:
        return
    scores = dict(zip(models, await asyncio.gather(*(score_responses(args, m, done) for m in models)), strict=True))
    for i, s in enumerate(done):
        if teachers:
            s.teacher_log_probs = mean_log_probs([scores[t][i] for t in teachers])
        if ref:
            s.ref_log_probs = scores[ref][i]


def needs_model_scoring(args: Any) -> bool:
    return bool((args.use_opd and args.opd_type == "sglang") or args.ref_model_name)
