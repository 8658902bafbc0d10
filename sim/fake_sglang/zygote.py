"""A fork server for CPU fake engines: `python -m sim.fake_sglang` is ready in ~0.8 s instead of ~9 CPU-seconds.

Why: a fake `hf` engine spends almost all of its start-up importing torch, transformers and the model classes
(docs/performance.md, "One run's CPU"), and the test suite starts such engines by the hundred: every
`slime train` run starts one or two. A zygote imports all of that once; each engine is then a `fork()` of it.

How it is used: the test session starts one zygote per worker (`conftest.py`) and exports its socket path as
`SLIME_SIM_ZYGOTE`. `python -m sim.fake_sglang ARGS` — still what slime's engine actor runs, with its pid, log
file and signals — finds the variable, hands the zygote its argv, environment, working directory and standard
streams (the descriptors themselves, over the Unix socket), and then stands in for the forked engine: it forwards
SIGTERM/SIGINT/SIGHUP, and exits with the engine's exit code (128 + N when a signal N ended it). When the
launcher dies without a word (SIGKILL, its parent gone), the engine sees its connection close and kills itself,
so an engine never outlives the process its owner started. The launcher binds the engine's HTTP port itself and
hands over the socket, so the process slime started is the one listening there. CUDA engines never use the
zygote (a forked CUDA context is unusable), nor do multi-node engines (rank 0 binds a rendezvous port of its own),
nor does anything when the variable is unset or the zygote does not answer: the launcher then simply runs the
engine itself.

The zygote is single-threaded (a fork copies only the calling thread; no lock can be held by another) and
reaps its children in its accept loop.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

from sim.fake_sglang.launch import ENV, HEADER, LISTEN_FD


def preload() -> None:
    """What every fake engine imports before it serves (the expensive part of its start)."""
    import torch  # noqa: F401
    import transformers  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401
    from transformers.models.qwen2 import modeling_qwen2  # noqa: F401
    from transformers.models.qwen3 import modeling_qwen3  # noqa: F401

    import sim.fake_sglang.__main__  # noqa: F401
    import sim.fake_sglang.hf_engine  # noqa: F401
    import sim.fake_sglang.scripted_engine  # noqa: F401
    import sim.fake_sglang.server  # noqa: F401
    import sim.fake_sglang.synthetic_engine  # noqa: F401


# ---- the zygote's side -----------------------------------------------------------------------------------
def _read_request(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 4)
    if len(data) < HEADER:
        data += _recv_exact(conn, HEADER - len(data))
    size = int.from_bytes(data[:HEADER], "big")
    body = data[HEADER:]
    if len(body) < size:
        body += _recv_exact(conn, size - len(body))
    return json.loads(body), fds


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    chunks = []
    while n > 0:
        chunk = conn.recv(min(n, 1 << 20))
        if not chunk:
            raise ConnectionError("launcher closed the connection mid-request")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _die_with_launcher(conn: socket.socket) -> None:
    """In the engine: the launcher's end of `conn` closing (it died) ends this process, as a SIGKILL would."""

    def watch() -> None:
        with contextlib.suppress(OSError):
            while conn.recv(1):
                pass
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="zygote-launcher-watch", daemon=True).start()


def _run_child(request: dict[str, Any], fds: list[int], conn: socket.socket) -> None:
    """In the forked process: become the engine the launcher asked for; never returns."""
    code = 1
    try:
        os.setsid()  # signals for the zygote's process group are not the engine's
        for target, fd in zip((0, 1, 2), fds[:3], strict=True):
            os.dup2(fd, target)
        for fd in fds[:3]:
            os.close(fd)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(request["env"])
        os.environ.pop(ENV, None)  # this engine is the fork; nothing it starts asks the zygote again
        os.environ[LISTEN_FD] = str(fds[3])
        os.chdir(request["cwd"])
        import torch

        if threads := int(os.environ.get("OMP_NUM_THREADS", "0") or 0):
            torch.set_num_threads(threads)  # OpenMP read the zygote's environment when torch loaded
        _die_with_launcher(conn)
        from sim.fake_sglang.__main__ import main

        sys.argv = ["python -m sim.fake_sglang", *request["argv"]]
        main(request["argv"])
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported on the engine's own stderr, like an uncaught error
        import traceback

        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def serve(path: str) -> None:
    """Accept launchers on `path` until SIGTERM; fork one engine per launcher; report each engine's exit."""
    stopping = False

    def stop(_sig: int, _frame: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    listener.bind(path)
    listener.listen(64)
    listener.settimeout(0.1)
    print(f"zygote ready {path}", flush=True)
    children: dict[int, socket.socket] = {}
    try:
        while not stopping:
            try:
                conn, _ = listener.accept()
            except (TimeoutError, InterruptedError):
                conn = None
            if conn is not None:
                conn.settimeout(None)
                try:
                    request, fds = _read_request(conn)
                except (OSError, ValueError, ConnectionError):
                    conn.close()
                    continue
                if len(fds) != 4:  # stdin, stdout, stderr and the HTTP socket, or nothing to run
                    for fd in fds:
                        os.close(fd)
                    conn.close()
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    listener.close()
                    for other in children.values():
                        other.close()
                    _run_child(request, fds, conn)
                for fd in fds:
                    os.close(fd)
                children[pid] = conn
                with contextlib.suppress(OSError):
                    conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            while children:
                try:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                conn = children.pop(pid, None)
                if conn is not None:
                    with contextlib.suppress(OSError):
                        conn.sendall(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
                    conn.close()
    finally:
        for pid in children:  # an engine never outlives the zygote either
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


@contextlib.contextmanager
def zygote() -> Iterator[str]:
    """A zygote for this process and its descendants (`SLIME_SIM_ZYGOTE` set while inside); yields its socket
    path. It starts in the background: until it listens, launchers run engines themselves. Stopped on exit."""
    folder = tempfile.mkdtemp(prefix="slime-zygote-")
    path = os.path.join(folder, "zygote.sock")
    from sim.fake_sglang.testing import fake_env
    from slime.utils.process import die_with_parent, stop_popen

    proc = subprocess.Popen(  # its own process group, and it goes when the test worker dies
        [sys.executable, "-m", "sim.fake_sglang.zygote", "--socket", path],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        env=fake_env(),
        preexec_fn=die_with_parent,
    )
    before = os.environ.get(ENV)
    os.environ[ENV] = path
    try:
        yield path
    finally:
        if before is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = before
        stop_popen(proc)
        with contextlib.suppress(OSError):
            os.unlink(path)
            os.rmdir(folder)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m sim.fake_sglang.zygote", description=__doc__.split("\n\n")[0])
    p.add_argument("--socket", required=True, help="Unix socket path to listen on")
    a = p.parse_args(argv)
    preload()
    serve(a.socket)


if __name__ == "__main__":
    main()
