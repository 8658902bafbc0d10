"""The bounded buffer of finished groups between the fully-async producer and the trainer.

The default is FIFO: the trainer takes groups in the order they finished, so the oldest finished work trains
first. `--custom-async-data-buffer-path pkg.mod.Class` replaces it with any class built as `Class(args, capacity)`
that offers the same five members (`capacity`, `__len__`, `__iter__`, `put`, `pop`); a buffer that pops the
freshest group first, or the shortest, is a few lines. The producer never puts into a full buffer (it waits
for room), so `put` may refuse one.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any, Protocol

from slime.utils.types import Sample

Group = list[Any]  # one prompt's trajectories: Samples, or lists of Samples for a fan-out trajectory


class GroupBufferLike(Protocol):
    capacity: int

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Group]: ...

    def put(self, group: Group) -> None: ...

    def pop(self, n: int) -> list[Group]: ...


class GroupBuffer:
    """FIFO of at most `capacity` finished groups."""

    def __init__(self, args: Any, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"async data buffer capacity must be >= 1 group, got {capacity}")
        self.capacity = capacity
        self._groups: deque[Group] = deque()

    def __len__(self) -> int:
        return len(self._groups)

    def __iter__(self) -> Iterator[Group]:
        return iter(list(self._groups))

    def put(self, group: Group) -> None:
        if len(self._groups) >= self.capacity:
            raise RuntimeError(f"async data buffer is full ({self.capacity} groups); the producer must wait")
        self._groups.append(group)

    def pop(self, n: int) -> list[Group]:
        """Up to `n` groups, oldest first."""
        return [self._groups.popleft() for _ in range(min(n, len(self._groups)))]


def group_to_json(group: Group) -> list[Any]:
    """A group as JSON-able dicts; a fan-out trajectory stays a list of segments."""
    return [[s.to_dict() for s in item] if isinstance(item, list) else item.to_dict() for item in group]


def group_from_json(data: list[Any]) -> Group:
    return [[Sample.from_dict(d) for d in item] if isinstance(item, list) else Sample.from_dict(item) for item in data]
