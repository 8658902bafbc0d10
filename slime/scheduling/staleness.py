"""How stale a group of samples is, and how a stale group starts over.

A group's staleness is the trainer's weight version when the group is consumed minus the oldest weight version
that produced any of its trained response tokens. Each `/generate` answer records one
`[version, tokens, trained]` span on the sample (`Sample.weight_version_spans`); one version per answer is exact
because a weight sync aborts running requests before it loads (their tokens so far come back under the old
version and the rest is generated under the new one); with `--update-weights-in-flight` an answer can run
through a sync, and its span takes the oldest version it may hold (`bound_answer_version`). Tokens that `--mask-offpolicy-in-partial-rollout` turns
into context (loss mask 0) teach the trainer nothing, so they do not count: their span's `trained` flag is off.

Versions are the integers slime pushes with each sync (`rollout_id + 1`, docs/architecture.md#weight-sync). A
sample without spans (a custom generate function that never folds SGLang's `meta_info`) falls back to its
`weight_versions`, then to the version of the engines when the producer first dispatched it (a lower bound of
every version its tokens can have, since versions only grow).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from slime.utils.types import Sample

# metadata key: the engines' weight version when a fully-async producer first dispatched the sample
DISPATCH_VERSION_KEY = "dispatch_weight_version"
# what generating a sample fills in; a retried group gets them back as a fresh `Sample` has them
GENERATED_FIELDS = (
    "response",
    "response_length",
    "reward",
    "loss_mask",
    "rollout_log_probs",
    "rollout_routed_experts",
    "teacher_log_probs",
    "ref_log_probs",
    "weight_versions",
    "weight_version_spans",
    "remove_sample",
    "status",
)


def parse_version(value: Any) -> int | None:
    """slime's versions are integers sent as strings; SGLang's initial "default" (never synced) is not one."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def flatten(group: Iterable[Sample | Sequence[Sample]]) -> list[Sample]:
    """The samples of a prompt group; a fan-out trajectory (a list of segments) contributes all its segments."""
    return [s for item in group for s in (item if isinstance(item, list | tuple) else [item])]


def sample_min_version(sample: Sample) -> int | None:
    """The oldest weight version among the sample's trained response tokens (None: nothing to go by)."""
    if sample.weight_version_spans:
        versions = [parse_version(v) for v, n, trained in sample.weight_version_spans if n > 0 and trained]
        versions = [v for v in versions if v is not None]
        return min(versions) if versions else None
    versions = [v for v in map(parse_version, sample.weight_versions) if v is not None]
    if versions:
        return min(versions)
    return parse_version(sample.metadata.get(DISPATCH_VERSION_KEY))


def group_min_version(group: Iterable[Sample | Sequence[Sample]]) -> int | None:
    versions = [v for v in map(sample_min_version, flatten(group)) if v is not None]
    return min(versions) if versions else None


def group_staleness(group: Iterable[Sample | Sequence[Sample]], trainer_version: int) -> int:
    """`trainer_version` − the group's oldest trained-token version; 0 for a group with no version at all."""
    oldest = group_min_version(group)
    return 0 if oldest is None else max(0, trainer_version - oldest)


def mark_context_only(sample: Sample) -> None:
    """The response so far becomes context: loss mask 0 on every token, and its spans stop counting."""
    sample.loss_mask = [0] * sample.response_length
    for span in sample.weight_version_spans:
        span[2] = False


def mask_tokens_older_than(sample: Sample, oldest_allowed: int, dry_run: bool = False) -> int | None:
    """Tokens of trained spans sampled under a version older than `oldest_allowed` become context (loss mask 0,
    span untrained); returns how many newly masked. None when the spans do not cover the response one to one (a
    generate function that reports no per-answer token counts): then tokens cannot be told apart by version.
    `dry_run`: count only."""
    spans = sample.weight_version_spans
    if sum(int(n) for _, n, _ in spans) != sample.response_length:
        return None
    mask = sample.loss_mask if sample.loss_mask is not None else [1] * sample.response_length
    if dry_run:
        mask = list(mask)
    masked, pos = 0, 0
    for span in spans:
        version, n = parse_version(span[0]), int(span[1])
        if span[2] and version is not None and version < oldest_allowed:
            masked += sum(mask[pos : pos + n])
            mask[pos : pos + n] = [0] * n
            if not dry_run:
                span[2] = False
        pos += n
    if not dry_run:
        sample.loss_mask = mask
    return masked


def bound_answer_version(sample: Sample, sent_under: int | None) -> None:
    """With `--update-weights-in-flight` one `/generate` answer may run through weight syncs, and SGLang reports
    only the version it ended under. Its tokens were sampled under versions from `sent_under` (the engines'
    version when it was sent) to that one, so the answer's span takes `sent_under`: a lower bound of each of its
    tokens' versions, which never under-counts staleness (the bound stays safe; `mask` masks the whole answer)."""
    if sent_under is None or not sample.weight_version_spans:
        return
    last = sample.weight_version_spans[-1]
    reported = parse_version(last[0])
    if reported is not None and reported > sent_under:
        last[0] = str(sent_under)


def stamp_dispatch_version(group: Iterable[Sample | Sequence[Sample]], version: int | None) -> None:
    """Remember the engines' version at the first dispatch (the fallback lower bound above); kept on resume."""
    if version is None:
        return
    for s in flatten(group):
        s.metadata.setdefault(DISPATCH_VERSION_KEY, version)


def reset_for_retry(group: list[Sample | list[Sample]]) -> list[Sample]:
    """The group back to its prompts, to be generated again from scratch with the current weights.

    A fan-out trajectory (a list of segments) starts over from its first segment, whose tokens begin with the
    prompt. The sampling seed stays: with new weights it draws a new answer, and a resumed run draws the same."""
    out = []
    for item in group:
        fanned_out = isinstance(item, list | tuple)
        s = item[0] if fanned_out else item
        prompt_len = len(s.tokens) - s.response_length
        s.tokens = list(s.tokens[:prompt_len])
        fresh = Sample()
        for name in GENERATED_FIELDS:
            setattr(s, name, getattr(fresh, name))
        s.metadata.pop(DISPATCH_VERSION_KEY, None)
        s.metadata.pop("start_rollout_id", None)
        if fanned_out:  # the fan-out set these on its segments; the prompt had its own (usually none)
            s.group_id = None
            for key in ("segment_idx", "num_segments"):
                s.metadata.pop(key, None)
        out.append(s)
    return out


def staleness_metrics(groups: Sequence[Any], trainer_version: int) -> dict[str, float]:
    """Mean and max staleness of a rollout's groups (those that carry any version), for every scheduling mode."""
    values = []
    for g in groups:
        group = g if isinstance(g, list | tuple) else [g]
        if group_min_version(group) is not None:
            values.append(group_staleness(group, trainer_version))
    if not values:
        return {}
    return {"async/staleness_mean": sum(values) / len(values), "async/staleness_max": float(max(values))}
