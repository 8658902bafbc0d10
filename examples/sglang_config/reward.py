"""Custom reward that asks the `reward` model of `--sglang-config` for a score.

Use with `--custom-rm-path examples.sglang_config.reward.reward_model_rm`. The reward model is any model
named `reward` in the YAML; its router is found with `get_model_url(args, "reward")`, so the function works
unchanged whether the reward model runs on 1 engine or 100.
"""

from __future__ import annotations

import re
from typing import Any

from slime.rollout.sglang_rollout import get_model_url
from slime.utils.http_utils import post_json
from slime.utils.types import Sample

_SCORE_RE = re.compile(r"score:\s*(-?[0-9]+(?:\.[0-9]+)?)")


def parse_score(text: str) -> float:
    """The first `score: <x>` in the judge's answer; a judge that gives none scores 0 (logged by the caller)."""
    m = _SCORE_RE.search(text or "")
    return float(m.group(1)) if m else 0.0


async def reward_model_rm(args: Any, sample: Sample) -> float:
    prompt = f"Score the response.\nResponse: {sample.response}\nScore:"
    out = await post_json(
        get_model_url(args, "reward", "/generate"),
        {"text": prompt, "sampling_params": {"max_new_tokens": 16, "temperature": 0.0}},
    )
    return parse_score(out.get("text", ""))
