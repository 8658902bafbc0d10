"""`slime/backends/megatron/lean_import.py`: megatron-core imports without dynamo/inductor and wandb, and its
fusion functions still compile (lazily) when called."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.cpu

_PROBE = r"""
import json, sys, torch
real = torch.compile
import slime.backends.megatron.model_provider  # imports megatron.core through the package's finder
import megatron.core.jit as jit
from slime.backends.megatron import lean_import
loaded = {m: m in sys.modules for m in ("torch._dynamo", "torch._inductor", "wandb")}
fuser_is_lazy = jit.jit_fuser is lean_import.lazy_compile
restored = torch.compile is real
finder_gone = not any(isinstance(f, lean_import._Finder) for f in sys.meta_path)
import wandb  # slime's --use-wandb imports it after megatron: it must still be importable
def f(x):
    return torch.sin(x) * 2 + 1
g = lean_import.lazy_compile(f, backend="eager")
before = "torch._dynamo" in sys.modules
x = torch.linspace(-1, 1, 7)
same = bool(torch.equal(g(x), f(x)))
print(json.dumps({"loaded": loaded, "fuser_is_lazy": fuser_is_lazy, "restored": restored, "finder_gone": finder_gone,
                  "wandb_ok": hasattr(wandb, "__version__") or hasattr(wandb, "init"), "dynamo_before_call": before,
                  "dynamo_after_call": "torch._dynamo" in sys.modules, "same": same, "name": g.__name__}))
"""


def test_megatron_imports_lean_and_fusions_compile_on_first_call() -> None:
    pytest.importorskip("megatron.core")
    pytest.importorskip("wandb")
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", _PROBE], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["loaded"] == {"torch._dynamo": False, "torch._inductor": False, "wandb": False}
    assert r["fuser_is_lazy"] and r["restored"] and r["finder_gone"] and r["wandb_ok"]
    # compiled on the first call, not when applied, and computing what the function computes
    assert not r["dynamo_before_call"] and r["dynamo_after_call"] and r["same"] and r["name"] == "f"
