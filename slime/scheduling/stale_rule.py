"""What happens to a group over the staleness bound: the one rule of `--async-unused-samples-handler`, applied
alike where `--fully-async` consumes and where `--partial-rollout` (or any sync rollout) hands its groups over.

- `retry`: its prompts go back to the data source and are generated again from scratch, once; a group stale
  again is dropped (its generation takes longer than the bound allows, and retrying forever would loop).
- `drop`: dropped and counted.
- `mask`: the group is kept and corrected, per token. Every response token sampled under a version older than
  `trainer_version − k` becomes context (loss mask 0, its span no longer trained); the tokens within the bound
  train, each with the behaviour log-prob it was sampled with (TIS/IcePop weigh them per token). A group left
  with no trainable token is dropped. Nothing is regenerated, so a long answer that outlived the bound costs
  only its old tokens' gradient, not a second generation (docs/async.md#which-tokens-train).

Why `mask` is per token rather than per sample: the bound is about the policy a token was drawn from, and an
answer resumed across syncs (partial rollout) or running through them (`--update-weights-in-flight`) holds
tokens of several versions; its newest tokens are as fresh as any short answer's.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Protocol

from slime.scheduling.staleness import flatten, group_staleness, mask_tokens_older_than, reset_for_retry
from slime.utils.types import Sample

logger = logging.getLogger(__name__)

HANDLERS = ("retry", "drop", "mask")
RETRIES_KEY = "async_stale_retries"  # sample metadata: how often the group was regenerated for staleness


class SampleSink(Protocol):
    def add_samples(self, groups: list[Any]) -> None: ...


def mask_stale_group(group: Sequence[Any], trainer_version: int, max_staleness: int) -> int | None:
    """Turn every token of `group` older than the bound into context; the tokens masked, or None when the group
    cannot be kept: a sample whose spans do not cover its response (a custom generate function that reports no
    versions), or nothing left to train. Nothing is changed when None is returned."""
    samples: list[Sample] = flatten(group)
    oldest_allowed = trainer_version - max_staleness
    plans = [mask_tokens_older_than(s, oldest_allowed, dry_run=True) for s in samples]
    if any(p is None for p in plans):
        return None
    trainable = sum(s.effective_response_length for s in samples) - sum(plans)  # type: ignore[arg-type]
    if trainable <= 0:
        return None
    return sum(mask_tokens_older_than(s, oldest_allowed) or 0 for s in samples)


def settle_stale_group(
    group: list[Any], handler: str, source: SampleSink, trainer_version: int | None = None, max_staleness: int = 0
) -> tuple[str, int]:
    """A group over the bound: ("kept", tokens masked) under `mask` when it can be kept, else ("retried", 0) with
    its prompts back in `source` (`retry`, first time), else ("dropped", 0)."""
    if handler == "mask" and trainer_version is not None:
        masked = mask_stale_group(group, trainer_version, max_staleness)
        if masked is not None:
            return "kept", masked
        return "dropped", 0  # nothing trainable within the bound: regenerating it would be a retry, not a mask
    retries = int(flatten(group)[0].metadata.get(RETRIES_KEY, 0))
    if handler != "retry" or retries > 0:
        return "dropped", 0
    fresh = reset_for_retry(group)
    for s in fresh:
        s.metadata[RETRIES_KEY] = retries + 1
    source.add_samples([fresh])
    return "retried", 0


def filter_stale_groups(
    groups: list[Any], trainer_version: int, max_staleness: int | None, handler: str, source: SampleSink
) -> tuple[list[Any], list[Any], dict[str, float]]:
    """The staleness bound outside the fully-async buffer (a rollout's groups, e.g. ones --partial-rollout
    recycled with old tokens): (the groups within it or masked into it, the groups dropped, the counts)."""
    if max_staleness is None:
        return groups, [], {}
    kept, dropped = [], []
    counts = {"stale": 0, "retried": 0, "dropped": 0, "masked_groups": 0, "masked_tokens": 0}
    for g in groups:
        group = g if isinstance(g, list) else [g]
        if group_staleness(group, trainer_version) <= max_staleness:
            kept.append(g)
            continue
        counts["stale"] += 1
        verdict, masked = settle_stale_group(group, handler, source, trainer_version, max_staleness)
        if verdict == "kept":
            kept.append(g)
            counts["masked_groups"] += 1
            counts["masked_tokens"] += masked
        elif verdict == "retried":
            counts["retried"] += 1
        else:
            dropped.append(g)
            counts["dropped"] += 1
    if not counts["stale"]:
        return kept, [], {}
    return (
        kept,
        dropped,
        {
            "async/stale_groups": float(counts["stale"]),
            "async/stale_retried_groups": float(counts["retried"]),
            "async/stale_dropped_groups": float(counts["dropped"]),
            "async/stale_masked_groups": float(counts["masked_groups"]),
            "async/stale_masked_tokens": float(counts["masked_tokens"]),
        },
    )
