"""Test helpers: start a fake server as a subprocess and always stop it (process group, SIGTERM then SIGKILL)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

from slime.utils.http_utils import find_free_port


@dataclass
class Launched:
    url: str
    proc: subprocess.Popen
    ready_line: str


def stop_process(proc: subprocess.Popen, timeout: float = 10.0) -> int | None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode


@contextlib.contextmanager
def launch_fake_sglang(
    args: list[str], *, module: str = "sim.fake_sglang", timeout: float = 90.0
) -> Iterator[Launched]:
    """Run ``python -m <module> --host 127.0.0.1 --port <free> <args>``; yield once it printed its ready line."""
    port = find_free_port()
    cmd = [sys.executable, "-m", module, "--host", "127.0.0.1", "--port", str(port), *args]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=None, text=True, start_new_session=True, env=env)
    try:
        deadline = time.time() + timeout
        line = ""
        while time.time() < deadline:
            line = proc.stdout.readline()
            if "ready http://" in line:
                break
            if proc.poll() is not None:
                raise RuntimeError(f"{module} exited with {proc.returncode} before ready: {cmd}")
        else:
            raise TimeoutError(f"{module} not ready after {timeout}s")
        yield Launched(f"http://127.0.0.1:{port}", proc, line.strip())
    finally:
        stop_process(proc)
        if proc.stdout:
            proc.stdout.close()
