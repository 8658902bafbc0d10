"""`ManagedProcess.wait_healthy(port=...)`: a health answer counts only from a process of our own tree.

Seen in a parallel test run: a fake engine lost its port to another test's server between choosing and binding
it, the other server answered `/health`, and the run hung talking to a stranger.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest

from slime.utils.http_utils import find_free_port
from slime.utils.process import ManagedProcess, port_conflict, start_with_free_port

pytestmark = pytest.mark.cpu

LISTEN = "import socket, sys, time; s = socket.socket(); s.bind(('127.0.0.1', int(sys.argv[1]))); s.listen(); time.sleep(60)"


def test_a_stranger_on_the_port_does_not_count() -> None:
    port = find_free_port(host="127.0.0.1")
    stranger = socket.socket()
    stranger.bind(("127.0.0.1", port))
    stranger.listen()
    child = ManagedProcess.start([sys.executable, "-c", "import time; time.sleep(60)"], name="quiet child")
    try:
        with pytest.raises(TimeoutError):
            child.wait_healthy(lambda: True, timeout=1.5, port=port)  # the probe says yes, the port is not ours
    finally:
        child.stop()
        stranger.close()


def test_our_child_listening_counts() -> None:
    port = find_free_port(host="127.0.0.1")
    child = ManagedProcess.start([sys.executable, "-c", LISTEN, str(port)], name="listening child")
    try:
        child.wait_healthy(lambda: True, timeout=30, port=port)
        assert child.proc.poll() is None
    finally:
        child.stop()


def _start_listener(ports: list[int], started: list[ManagedProcess]) -> ManagedProcess:
    """One attempt of a server start: the next port of `ports`, a child that binds it, then wait until healthy."""
    port = ports.pop(0)
    child = ManagedProcess.start([sys.executable, "-c", LISTEN, str(port)], name=f"listener {port}")
    started.append(child)
    child.wait_healthy(lambda: True, timeout=30, port=port)
    child.bound_port = port  # type: ignore[attr-defined]
    return child


def test_a_lost_port_race_is_retried_on_a_new_port() -> None:
    held = find_free_port(host="127.0.0.1")
    stranger = socket.socket()
    stranger.bind(("127.0.0.1", held))
    stranger.listen()
    fresh = find_free_port(host="127.0.0.1")
    started: list[ManagedProcess] = []
    try:
        child = start_with_free_port(lambda: _start_listener([held, fresh][len(started) :], started), "listener")
        assert child.bound_port == fresh and len(started) == 2  # type: ignore[attr-defined]
        assert started[0].proc.returncode not in (None, 0)  # the first child could not bind and exited
    finally:
        for c in started:
            c.stop()
        stranger.close()


def test_other_start_failures_are_not_retried() -> None:
    started: list[ManagedProcess] = []

    def start() -> ManagedProcess:
        child = ManagedProcess.start([sys.executable, "-c", "raise SystemExit(3)"], name="broken child")
        started.append(child)
        child.wait_healthy(lambda: False, timeout=30, port=find_free_port(host="127.0.0.1"))
        return child

    with pytest.raises(RuntimeError, match="exited with code 3") as err:
        start_with_free_port(start, "broken")
    assert len(started) == 1 and not port_conflict(err.value)


_FORKER = r"""
import multiprocessing, os, sys, time
from slime.utils.process import forks_die_with_this_process
if sys.argv[1] == "on":
    forks_die_with_this_process()
child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,), daemon=False)
child.start()
print(child.pid, flush=True)
os.kill(os.getpid(), 9)  # as an actor killed in the middle of a save
"""


@pytest.mark.parametrize("hook", ["on", "off"])
def test_forks_die_with_the_process_that_forked_them(hook):
    """A fork of a process that called `forks_die_with_this_process` is killed when that process dies; without
    the call it outlives it (the negative control: the orphan megatron's checkpoint writer used to leave)."""
    proc = subprocess.Popen([sys.executable, "-c", _FORKER, hook], stdout=subprocess.PIPE, text=True)
    pid = int(proc.stdout.readline())  # not to EOF: the fork holds the pipe open while it lives
    assert proc.wait(timeout=60) == -signal.SIGKILL
    proc.stdout.close()

    def alive() -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    try:
        if hook == "on":
            deadline = time.monotonic() + 10
            while alive() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not alive()
        else:
            time.sleep(1)
            assert alive()
    finally:
        if alive():
            os.kill(pid, signal.SIGKILL)
