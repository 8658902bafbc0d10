"""Token-level F1 between a response and a reference answer, normalised as in the SQuAD v1.1 evaluator.

Why SQuAD's normalisation: it is the de-facto standard for short-answer QA rewards, so scores stay comparable
with published numbers (lower case, drop punctuation and the articles a/an/the, collapse whitespace).
"""

from __future__ import annotations

import re
import string
from collections import Counter
from typing import Any

_PUNCT = set(string.punctuation)
_ARTICLES_RE = re.compile(r"\b(a|an|the)\b")


def normalize_f1_text(text: str) -> str:
    s = "".join(c for c in str(text).lower() if c not in _PUNCT)
    s = _ARTICLES_RE.sub(" ", s)
    return " ".join(s.split())


def _f1(pred_tokens: list[str], gold_tokens: list[str]) -> float:
    if not pred_tokens or not gold_tokens:
        # SQuAD: an empty side scores 1 only when both are empty
        return float(pred_tokens == gold_tokens)
    common = Counter(pred_tokens) & Counter(gold_tokens)
    overlap = sum(common.values())
    if overlap == 0:
        return 0.0
    precision = overlap / len(pred_tokens)
    recall = overlap / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def f1_score(response: str, label: Any) -> float:
    """F1 in [0, 1]; a list label holds several acceptable answers and the best one counts."""
    labels = label if isinstance(label, (list, tuple)) else [label]
    pred = normalize_f1_text(response).split()
    return max((_f1(pred, normalize_f1_text("" if g is None else g).split()) for g in labels), default=0.0)
