"""Rewards from a reward model of `--sglang-config` (`--rm-model-name`), asked through its router.

Two ways to ask, both with the judge prompt of `--rm-judge-template` (placeholders {prompt}, {response}, {label}),
whose answer must contain `score: <number>`:

* `--rm-type reward_model`: scoring in the style of `remote_rm` — one sample in, one number out — batched: a whole
  group (or any list of samples) is one native `/generate` request with one prompt per sample (greedy, at most
  `--rm-judge-max-tokens` tokens);
* `--rm-type reward_model_chat`: a generative judge through the OpenAI-compatible `/v1/chat/completions`, the
  prompt as one user message (the server applies the reward model's chat template), one request per sample.

Transient failures (connection errors, 5xx, 429) are retried with backoff (remote.py `post_with_retries`); an
answer without a score is an error naming the sample and the answer, never a silent 0.
"""

from __future__ import annotations

import asyncio
import functools
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from slime.rollout.model_urls import get_model_url
from slime.rollout.rm_hub.remote import RemoteRMError, post_with_retries
from slime.utils.types import Sample

DEFAULT_JUDGE_TEMPLATE = (
    "Score the response to the prompt from 0 to 1.\n"
    "Prompt: {prompt}\n"
    "Response: {response}\n"
    "Reference answer: {label}\n"
    "Answer with `score: <number>`."
)
_SCORE_RE = re.compile(r"score:\s*(-?[0-9]+(?:\.[0-9]+)?)", re.IGNORECASE)


class RewardModelError(RemoteRMError):
    """The reward model could not be asked, or its answer holds no score."""


@functools.lru_cache(maxsize=8)
def _template(path: str | None) -> str:
    return Path(path).read_text() if path else DEFAULT_JUDGE_TEMPLATE


def _prompt_text(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    return "\n".join(str(m.get("content", "")) for m in prompt if isinstance(m, dict))  # chat messages


def judge_prompt(args: Any, sample: Sample) -> str:
    return _template(args.rm_judge_template).format(
        prompt=_prompt_text(sample.prompt), response=sample.response, label=sample.label
    )


def parse_score(text: str, sample: Sample, model: str) -> float:
    m = _SCORE_RE.search(text or "")
    if m is None:
        raise RewardModelError(f"reward model {model!r} gave sample {sample.index} no `score: <x>`: {text[:200]!r}")
    return float(m.group(1))


async def reward_model_rewards(args: Any, samples: Sequence[Sample]) -> list[float]:
    """`--rm-type reward_model`: one batched `/generate` for all `samples`."""
    if not samples:
        return []
    model = args.rm_model_name
    url = get_model_url(args, model, "/generate")
    payload = {
        "text": [judge_prompt(args, s) for s in samples],
        "sampling_params": {"max_new_tokens": args.rm_judge_max_tokens, "temperature": 0.0},
    }
    answers = await post_with_retries(url, payload, what=f"reward model {model!r}")
    if not isinstance(answers, list) or len(answers) != len(samples):
        raise RewardModelError(f"reward model {model!r} answered {type(answers).__name__} for {len(samples)} prompts")
    return [parse_score(a.get("text", ""), s, model) for a, s in zip(answers, samples, strict=True)]


async def reward_model_chat_reward(args: Any, sample: Sample) -> float:
    """`--rm-type reward_model_chat`: one `/v1/chat/completions` call."""
    model = args.rm_model_name
    payload = {
        "model": model,
        "messages": [{"role": "user", "content": judge_prompt(args, sample)}],
        "max_tokens": args.rm_judge_max_tokens,
        "temperature": 0.0,
    }
    out = await post_with_retries(get_model_url(args, model, "/v1/chat/completions"), payload,
                                  what=f"reward model {model!r}")  # fmt: skip
    try:
        text = out["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        raise RewardModelError(f"reward model {model!r}: not a chat completion: {str(out)[:200]}") from None
    return parse_score(text or "", sample, model)


async def reward_model_chat_rewards(args: Any, samples: Sequence[Sample]) -> list[float]:
    return list(await asyncio.gather(*(reward_model_chat_reward(args, s) for s in samples)))
