"""Small helpers shared by every layer: import-path hooks."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from slime.utils.errors import SlimeArgError


def load_function(path: str) -> Callable[..., Any]:
    """Resolve a dotted import path `pkg.module.attr` (slime's `--*-path` hook convention)."""
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        raise SlimeArgError(f"import path {path!r} must look like 'package.module.function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise SlimeArgError(f"cannot import module {module_name!r} for hook {path!r}: {e}") from e
    try:
        return getattr(module, attr)
    except AttributeError as e:
        raise SlimeArgError(f"module {module_name!r} has no attribute {attr!r} (hook {path!r})") from e


def json_arg(text: str) -> Any:
    """argparse `type=` for flags that take JSON (a bad value becomes argparse's one-line error)."""
    import argparse
    import json

    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e.msg})") from e
