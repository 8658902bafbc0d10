"""Elementwise and row-reduction helpers compiled into single kernels on CUDA, eager everywhere else.

Why: without TransformerEngine, formulas such as RoPE or a log-softmax over a 150k-entry vocabulary run as a
chain of eager kernels, each reading and writing the whole tensor (and its fp32 copy). Compiled with dynamic
shapes, each becomes one kernel reading bf16 once, for every row count. On CPU (tests, laptops) the eager
formula runs, so results there are the formula's op-by-op ones; a host where compiling fails (no Triton, no C
compiler) falls back to eager once, with a warning, instead of stopping a run.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import torch

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])


def cuda_compiled(fn: F) -> F:
    """`fn` compiled (dynamic shapes) when its first argument is a CUDA tensor, else `fn` itself."""
    state: dict[str, Any] = {"compiled": None, "failed": False}

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        if state["failed"] or not args[0].is_cuda:
            return fn(*args, **kwargs)
        if state["compiled"] is None:
            state["compiled"] = torch.compile(fn, dynamic=True)
        try:
            return state["compiled"](*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - a compiler missing on the host must not stop training
            logger.warning("compiling %s failed (%s: %s); using the eager formula", fn.__name__, type(e).__name__, e)
            state["failed"] = True
            return fn(*args, **kwargs)

    return run  # type: ignore[return-value]
