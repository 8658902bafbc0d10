"""`ManagedProcess.wait_healthy(port=...)`: a health answer counts only from a process of our own tree.

Seen in a parallel test run: a fake engine lost its port to another test's server between choosing and binding
it, the other server answered `/health`, and the run hung talking to a stranger.
"""

from __future__ import annotations

import socket
import sys

import pytest

from slime.utils.http_utils import find_free_port
from slime.utils.process import ManagedProcess

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
