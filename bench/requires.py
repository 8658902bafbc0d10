"""Checks a bench runs before it starts, so a long run never fails at its end for a missing dependency."""

from __future__ import annotations

import importlib.util
import sys


def require(modules: list[str], install_hint: str) -> None:
    """Exit with one line naming what to install when any of `modules` cannot be imported."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        sys.exit(f"this bench needs {', '.join(missing)}: {install_hint}")


def require_cuda() -> None:
    import torch

    if not torch.cuda.is_available():
        sys.exit("this bench needs a CUDA GPU (README: 'One GPU host'; torch sees none here)")
