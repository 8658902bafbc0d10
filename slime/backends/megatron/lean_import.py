"""Import megatron-core without what its import pulls in but slime never uses: ~4.5 s less per process.

Why: `import megatron.core` took ~7 s of CPU on the 2-core development machine, and every train actor of every
run (and every test worker) pays it. Two things dominate, neither needed at import time:
- `megatron.core.jit.jit_fuser` is `torch.compile`, applied as a decorator to a dozen fusion functions while
  the modules load; the first `torch.compile(fn)` imports torch's dynamo and inductor (~3.5 s) even though
  the function is only compiled when first called. Inside the import `torch.compile` is `lazy_compile`, which
  compiles on the first call instead: a fusion that runs (`--bias-activation-fusion` on a GPU, say) is
  compiled exactly as before; one that never runs costs nothing.
- `megatron.core.inference` and `timers` try `import wandb` (~1.3 s) for their own logging, which slime does
  not use; inside the import `wandb` looks absent to them (their `ImportError` fallbacks). slime's own
  `--use-wandb` imports it later, unaffected.

`install()` (run by `slime/backends/megatron/__init__.py`, so by any slime module that uses megatron) puts a
finder on `sys.meta_path` that wraps the first `import megatron.core` and then removes itself. A process that
imported megatron before, or never does, is unaffected.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Callable, Iterator
from typing import Any

_TARGET = "megatron.core"


def lazy_compile(model: Callable[..., Any] | None = None, **options: Any) -> Any:
    """`torch.compile` that compiles on the first call rather than when applied (also as `@lazy_compile(...)`)."""
    if model is None:
        return functools.partial(lazy_compile, **options)
    compiled: Callable[..., Any] | None = None

    @functools.wraps(model)
    def run(*args: Any, **kwargs: Any) -> Any:
        nonlocal compiled
        if compiled is None:
            import torch

            compiled = (_real_compile or torch.compile)(model, **options)
        return compiled(*args, **kwargs)

    return run


_real_compile: Callable[..., Any] | None = None  # torch.compile itself while `lean()` stands in for it


@contextlib.contextmanager
def lean() -> Iterator[None]:
    """While importing megatron: `torch.compile` is lazy and `wandb` looks absent; both restored after."""
    import torch

    global _real_compile
    _real_compile = real = torch.compile
    hide_wandb = "wandb" not in sys.modules
    torch.compile = lazy_compile
    if hide_wandb:
        sys.modules["wandb"] = None  # type: ignore[assignment] - `import wandb` raises ImportError
    try:
        yield
    finally:
        torch.compile, _real_compile = real, None
        if hide_wandb and sys.modules.get("wandb", 0) is None:
            del sys.modules["wandb"]


class _LeanLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader) -> None:
        self.inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        with lean():
            self.inner.exec_module(module)  # megatron/core/__init__.py imports its subpackages


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != _TARGET:
            return None
        uninstall()
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            spec.loader = _LeanLoader(spec.loader)
        return spec


_FINDER = _Finder()


def install() -> None:
    """Wrap the process's first `import megatron.core` (nothing to do when it is already imported)."""
    if _TARGET not in sys.modules and _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def uninstall() -> None:
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
