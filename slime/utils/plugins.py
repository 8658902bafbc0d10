"""Entry points: how code outside slime (a simulator, a user's engine or shim) enters it without being named.

A distribution declares ``[project.entry-points."<group>"] name = "package.module:attr"`` in its metadata; slime
lists the group and loads what it names. The same distribution may be found twice (an editable install's metadata
and the source tree's egg-info, for a host that runs from PYTHONPATH): names are kept once.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import Any


def entry_points(group: str) -> dict[str, str]:
    """{name: "package.module:attr"} of one entry-point group."""
    return {ep.name: ep.value for ep in importlib.metadata.entry_points(group=group)}


def load(target: str) -> Any:
    """The object `package.module:attr` (or `package.module.attr`) names; raises ImportError or AttributeError."""
    module, sep, attr = target.partition(":")
    if not sep:
        module, _, attr = target.rpartition(".")
    if not module or not attr:
        raise ImportError(f"{target!r} is not an import path (package.module:name)")
    return getattr(importlib.import_module(module), attr)
