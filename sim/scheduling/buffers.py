"""A custom buffer for `--custom-async-data-buffer-path` (and the simulator's tests): newest finished group first.

Why it exists: a buffer that serves the freshest work first keeps mean staleness low but lets old groups wait,
so it is the case where the staleness filter, not the producer's admission, keeps the bound. The property
tests run it to show the bound holds for any pop order.
"""

from __future__ import annotations

from slime.scheduling.group_buffer import Group, GroupBuffer


class NewestFirstBuffer(GroupBuffer):
    def pop(self, n: int) -> list[Group]:
        return [self._groups.pop() for _ in range(min(n, len(self._groups)))]
