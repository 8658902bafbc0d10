"""The SGLang side venv (`.venv-sglang`, ci/sglang_venv.sh) for tests that run SGLang's own parser on CPU."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def side_venv_python() -> str:
    """The side venv's interpreter; missing is a failure under CI=true (CI installs it), a skip locally."""
    venv = Path(os.environ.get("SLIME_SGLANG_VENV", ROOT / ".venv-sglang"))
    py = venv / "bin" / "python"
    if not py.exists():
        msg = f"SGLang side venv not found at {venv}; create it with `bash ci/sglang_venv.sh`"
        if os.environ.get("CI") == "true":
            pytest.fail(msg)
        pytest.skip(msg)
    return str(py)
