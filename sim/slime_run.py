"""`slime train` as a subprocess for tests and benches: one place that starts it in its own session and kills the
whole process group on the way out (a timed-out or interrupted run must not leave Ray, engines or routers behind)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from slime.utils.process import die_with_parent, stop_popen

ROOT = Path(__file__).resolve().parents[1]


def run_slime_train(argv: list[str], log_path: Path, timeout: float, env: dict[str, str] | None = None) -> int:
    """Run `python -m slime.cli train ARGV` from the repository root, output to `log_path`; returns its exit code."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "slime.cli", "train", *argv],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent,
        )  # fmt: skip
        try:
            return proc.wait(timeout=timeout)
        finally:
            if proc.poll() is None:
                stop_popen(proc)
