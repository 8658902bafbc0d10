"""Buffer filters (`--buffer-filter-path`): which buffered groups a rollout takes before fresh prompts.

Signature: `fn(args, rollout_id, buffer, num_groups) -> list[list[Sample]]`; the filter removes what it
returns from `buffer` (in place), so whatever it leaves stays buffered for a later rollout.
"""

from __future__ import annotations

from typing import Any

from slime.utils.types import Sample


def pop_first(args: Any, rollout_id: int | None, buffer: list[list[Sample]], num_groups: int) -> list[list[Sample]]:
    """Oldest first: partially generated groups finish before their off-policy share grows."""
    n = min(len(buffer), num_groups)
    taken = buffer[:n]
    del buffer[:n]
    return taken
