"""The dynamic-sampling filter contract: `fn(args, group, **kwargs) -> DynamicFilterOutput | bool`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class DynamicFilterOutput:
    keep: bool
    # Why a group was dropped; becomes the metric `rollout/dynamic_filter/drop_<reason>`.
    reason: str | None = None


def call_dynamic_filter(
    fn: Callable[..., Any] | None, args: Any, group: list[Any], **kwargs: Any
) -> DynamicFilterOutput:
    """Run a filter, accepting legacy filters that return a bare bool."""
    if fn is None:
        return DynamicFilterOutput(keep=True)
    out = fn(args, group, **kwargs)
    if isinstance(out, DynamicFilterOutput):
        return out
    return DynamicFilterOutput(keep=bool(out))
