"""`slime train` (or any command) as a supervised subprocess for tests and benches: one place that starts it in its
own session and stops the whole process group on the way out (a timed-out, failed or interrupted run must not
leave Ray, engines or routers behind)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from slime.utils.process import die_with_parent, stop_popen

ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def supervised(cmd: list[str], log_path: Path, env: dict[str, str] | None = None) -> Iterator[subprocess.Popen]:
    """`cmd` from the repository root, stdout and stderr to `log_path`; whatever of its process group still runs
    when the block ends is stopped (SIGTERM, then SIGKILL)."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent
        )
        try:
            yield proc
        finally:
            if proc.poll() is None:
                stop_popen(proc)


def slime_train(
    argv: list[str], log_path: Path, env: dict[str, str] | None = None
) -> contextlib.AbstractContextManager:
    """`supervised(python -m slime.cli train ARGV)`: for callers that watch the run while it goes."""
    return supervised([sys.executable, "-m", "slime.cli", "train", *argv], log_path, env)


def run_slime_train(argv: list[str], log_path: Path, timeout: float, env: dict[str, str] | None = None) -> int:
    """Run `python -m slime.cli train ARGV` to its end (at most `timeout` seconds); returns its exit code."""
    with slime_train(argv, log_path, env) as proc:
        return proc.wait(timeout=timeout)
