"""Import-only `triton` stand-in for slime's SGLang side venv.

Why: SGLang imports triton at module top level (sglang/srt/utils/common.py), so reading its `ServerArgs`
parser would otherwise need the 1 GB triton wheel. Everything here is inert: decorators return the
function unchanged, any other attribute or submodule resolves to another inert stub, and nothing can run
a kernel. Never install this next to a real GPU stack.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

__version__ = "0.0.0+slime.stub"
IS_SLIME_STUB = True


class _Inert:
    """Base for stub classes, so `class K(triton.runtime.KernelInterface)` still defines a class."""


class _StubModule(types.ModuleType):
    """A package whose unknown attributes are stubs: lower-case names are modules, CamelCase are classes."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.__path__ = []
        self.__spec__ = importlib.machinery.ModuleSpec(name, _Finder, is_package=True)

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        if attr[:1].isupper():
            value: Any = type(attr, (_Inert,), {"__module__": self.__name__})
        else:
            value = _submodule(f"{self.__name__}.{attr}")
        setattr(self, attr, value)
        return value

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # Used as a decorator, bare (@triton.jit) or with arguments (@triton.autotune(configs=...)).
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return lambda fn: fn


def _submodule(name: str) -> _StubModule:
    mod = sys.modules.get(name)
    if not isinstance(mod, _StubModule):
        mod = _StubModule(name)
        sys.modules[name] = mod
    return mod


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes `import triton.anything.deeper` succeed with stub modules."""

    @classmethod
    def find_spec(cls, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, cls, is_package=True)
        return None

    @classmethod
    def create_module(cls, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _submodule(spec.name)

    @classmethod
    def exec_module(cls, module: types.ModuleType) -> None:
        return None


sys.meta_path.append(_Finder)


def jit(fn: Any = None, **kwargs: Any) -> Any:
    return fn if fn is not None else (lambda f: f)


def autotune(*args: Any, **kwargs: Any) -> Any:
    return lambda fn: fn


def heuristics(*args: Any, **kwargs: Any) -> Any:
    return lambda fn: fn


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


class Config(_Inert):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs = args, kwargs


def __getattr__(attr: str) -> Any:
    # Module-level fallback (PEP 562) for anything not defined above, e.g. triton.language, triton.runtime.
    if attr.startswith("__"):
        raise AttributeError(attr)
    if attr[:1].isupper():
        value: Any = type(attr, (_Inert,), {"__module__": __name__})
    else:
        value = _submodule(f"{__name__}.{attr}")
    globals()[attr] = value
    return value
