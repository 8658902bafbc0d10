"""Fixtures the GPU tests share."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def toy(tmp_path_factory) -> Path:
    """The toy task's data and tiny model (`examples.toy.prepare`), read-only for the `slime train` runs."""
    out = tmp_path_factory.mktemp("gpu_toy")
    subprocess.run([sys.executable, "-m", "examples.toy.prepare", "--out", str(out), "--num-train", "64",
                    "--num-eval", "4"], check=True, cwd=ROOT, timeout=300)  # fmt: skip
    return out
