"""Test helpers: start a fake server as a subprocess and always stop it.

Processes are started and stopped with slime's own supervision (slime/utils/process.py): own process group,
SIGTERM when the test process dies, SIGTERM to the group then SIGKILL. One implementation, so the fake is stopped
exactly as slime stops the servers it launches.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

from slime.utils.http_utils import find_free_port, port_is_free
from slime.utils.process import die_with_parent, start_with_free_port, stop_popen

STOP_GRACE_S = 10.0  # a fake engine aborts its in-flight requests before it exits


@dataclass
class Launched:
    url: str
    proc: subprocess.Popen
    ready_line: str


def stop_process(proc: subprocess.Popen, grace: float = STOP_GRACE_S) -> int | None:
    """`stop_popen` with the fake's grace period; kept because tests stop processes they start themselves."""
    return stop_popen(proc, grace)


def fake_env() -> dict[str, str]:
    """The environment a fake server runs in: no network look-ups by the HF libraries."""
    return dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")


@contextlib.contextmanager
def launch_fake_sglang(
    args: list[str], *, module: str = "sim.fake_sglang", timeout: float = 90.0, host: str = "127.0.0.1"
) -> Iterator[Launched]:
    """Run ``python -m <module> --host <host> --port <free> <args>``; yield once it printed its ready line.
    A fake that lost its port to another process (a second test worker) is started again on another one."""
    box: dict[str, subprocess.Popen] = {}

    def start() -> Launched:
        port = find_free_port(host=host)
        cmd = [sys.executable, "-m", module, "--host", host, "--port", str(port), *args]
        proc = box["proc"] = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, text=True, env=fake_env(), preexec_fn=die_with_parent
        )
        deadline = time.time() + timeout
        while time.time() < deadline:
            line = proc.stdout.readline()
            if "ready http://" in line:
                return Launched(f"http://{host}:{port}", proc, line.strip())
            if proc.poll() is not None:
                # its stderr went to ours; a port another process holds now is the one cause worth a retry
                taken = "" if port_is_free(host, port) else f" (port {port}: address already in use)"
                raise RuntimeError(f"{module} exited with {proc.returncode} before ready{taken}: {cmd}")
        raise TimeoutError(f"{module} not ready after {timeout}s")

    try:
        yield start_with_free_port(start, module)
    finally:
        proc = box.get("proc")
        if proc is not None:
            stop_popen(proc, STOP_GRACE_S)
            if proc.stdout:
                proc.stdout.close()
