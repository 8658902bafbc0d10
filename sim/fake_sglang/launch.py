"""The launcher's side of the fake engines' fork server (`sim/fake_sglang/zygote.py` says why and how).

`python -m sim.fake_sglang` calls `run_via_zygote` first: with a zygote to ask, this process binds the engine's
port, hands the zygote its argv, environment, working directory, standard streams and the bound socket, and stands
in for the fork until it exits; without one it returns None and the engine runs here. Kept apart from the zygote
(which imports the whole fake server) so that a launcher imports nothing heavy.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
from typing import Any

ENV = "SLIME_SIM_ZYGOTE"
LISTEN_FD = "SLIME_SIM_LISTEN_FD"  # in the fork: the descriptor of the HTTP socket its launcher bound
HEADER = 8  # bytes of the request's length prefix


def run_via_zygote(argv: list[str]) -> int | None:
    """Run the fake engine `argv` as a fork of the zygote named by `SLIME_SIM_ZYGOTE`; its exit code, or None
    when there is no zygote to ask (the caller then runs the engine itself)."""
    path = os.environ.get(ENV)
    if not path or path == "0" or _flag(argv, "--device", "cpu") == "cuda" or _flag(argv, "--nnodes", "1") != "1":
        return None  # CUDA cannot be forked; a multi-node engine's rank 0 binds a rendezvous port of its own
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
    except OSError:
        conn.close()
        return None
    try:
        # The launcher binds the engine's port itself and hands the socket over: the process slime started is
        # then the one listening there (slime checks that a healthy answer comes from its own child), and a
        # port taken meanwhile fails here, as the engine's own bind would.
        listener = _bind(argv)
    except (OSError, ValueError):
        conn.close()
        return None  # the engine, run here, meets the same error and reports it as it always does
    request = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    data = len(request).to_bytes(HEADER, "big") + request
    with conn, listener:
        sent = socket.send_fds(conn, [data], [0, 1, 2, listener.fileno()])
        conn.sendall(data[sent:])
        reader = conn.makefile("r")
        first = reader.readline()
        if not first:
            return None  # the zygote went away before forking: run it here
        pid = json.loads(first)["pid"]

        def forward(sig: int, _frame: Any) -> None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, forward)
        line = reader.readline()
    if not line:
        return 1  # the zygote died with the engine running; it took the engine with it (see serve())
    code = json.loads(line)["exit"]
    return 128 - code if code < 0 else code


def _flag(argv: list[str], name: str, default: str) -> str:
    for flag, value in zip(argv, argv[1:], strict=False):
        if flag == name:
            return value
    return default


def _bind(argv: list[str]) -> socket.socket:
    """A listening socket on the engine's `--host` / `--port` (as aiohttp binds it: address reuse on)."""
    host, port = _flag(argv, "--host", "127.0.0.1"), int(_flag(argv, "--port", "0"))
    if not port:
        raise OSError("no --port to bind")
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock
