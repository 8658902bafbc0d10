"""Reward for the toy task: how many digit positions of the reversal the model got right.

Why partial credit instead of exact match: a tiny random-init model almost never reverses a whole string,
so a 0/1 reward would give GRPO all-zero groups (no signal); per-position credit gives a gradient from the
first step. Extra or missing digits count as wrong positions, so padding or truncating never pays.

Use with `--custom-rm-path examples.toy.reward.reverse_digits_rm`.
"""

from __future__ import annotations

import re
from typing import Any

from slime.utils.types import Sample

_DIGITS_RE = re.compile(r"[0-9]+")  # ASCII only: the label is ASCII
_THINK_RE = re.compile(r"<think>.*?</think>", re.DOTALL)


def score_reverse(response: str, label: str) -> float:
    """Fraction of correct positions of the response's first digit run (after any closed <think> block)."""
    m = _DIGITS_RE.search(_THINK_RE.sub("", response or ""))
    answer = m.group(0) if m else ""
    label = str(label)
    denom = max(len(label), len(answer))
    if not answer or denom == 0:
        return 0.0
    return sum(a == b for a, b in zip(answer, label, strict=False)) / denom


async def reverse_digits_rm(args: Any, sample: Sample) -> float:
    return score_reverse(sample.response, sample.label)
