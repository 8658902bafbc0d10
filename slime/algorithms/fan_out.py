"""Validation of the fan-out contract: what a rollout / custom generate function may return.

The rollout output is `list[list[Sample]]` (prompt × trajectory). A generate function may return
`list[Sample]` for one trajectory (sub-agent or compaction segments), which makes the output one level
deeper; those siblings form one training group and must share one `group_id`. A mistake here would not
crash: the scheduler would silently treat segments as separate trajectories (or merge two trajectories),
skewing both the loss weights and GRPO statistics — hence the eager, one-line errors.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

from slime.utils.errors import SlimeArgError
from slime.utils.types import Sample

logger = logging.getLogger(__name__)

_HINT = "use slime.agent.trajectory.fan_out_sample_segments"


def _path(p: tuple[int, ...]) -> str:
    return "output" + "".join(f"[{i}]" for i in p)


def _trajectories(node: Any, path: tuple[int, ...]) -> Iterator[tuple[tuple[int, ...], list[Sample]]]:
    """Yield (path, samples) for each trajectory: a Sample at depth 1, or a list of Samples at depth >= 2."""
    if isinstance(node, Sample):
        if len(path) < 1:
            raise SlimeArgError("rollout output must be a list of sample groups, got a bare Sample")
        yield path, [node]
        return
    if not isinstance(node, list | tuple):
        raise SlimeArgError(f"{_path(path)} is a {type(node).__name__}; expected Sample or list of Samples")
    if len(path) >= 2 and node and all(isinstance(x, Sample) for x in node):
        yield path, list(node)
        return
    for i, child in enumerate(node):
        yield from _trajectories(child, path + (i,))


def validate_fan_out(output: Sequence[Any]) -> None:
    """Raise `SlimeArgError` (one line) unless every fanned-out trajectory has one shared, unique group id."""
    owner: dict[int, tuple[int, ...]] = {}
    for path, samples in _trajectories(output, ()):
        if len(samples) > 1:
            missing = [j for j, s in enumerate(samples) if s.group_id is None]
            if missing:
                raise SlimeArgError(
                    f"fan-out: {_path(path)} returns {len(samples)} samples but sample {missing[0]} has no "
                    f"group_id; siblings must share one group_id ({_HINT})"
                )
            ids = sorted({s.group_id for s in samples})
            if len(ids) > 1:
                raise SlimeArgError(
                    f"fan-out: siblings at {_path(path)} have different group ids {ids}; all samples returned "
                    f"for one trajectory must share one group_id ({_HINT})"
                )
            gid = ids[0]
        else:
            s = samples[0]
            if s.group_id is None and s.index is None:
                continue
            gid = s.train_group_id
        if gid in owner:
            raise SlimeArgError(
                f"fan-out: group id {gid} is used by two trajectories ({_path(owner[gid])} and {_path(path)}); "
                "group ids must be unique per trajectory"
            )
        owner[gid] = path


def flatten_samples(output: Sequence[Any]) -> list[Sample]:
    """All samples of a (possibly fanned-out) rollout output, in order."""
    return [s for _, samples in _trajectories(output, ()) for s in samples]


def assign_default_group_ids(samples: Sequence[Sample]) -> None:
    """A sample without a group id is its own trajectory: its group id becomes `Sample.train_group_id`."""
    for s in samples:
        try:
            s.group_id = s.train_group_id
        except ValueError as e:
            raise SlimeArgError(str(e)) from None
