"""Child processes slime supervises: inference servers, routers, agent CLIs, fake engines in tests.

One lifecycle for all of them, so a fix to how a child is started or stopped reaches every kind:
- start in its own process group (a stop reaches the tools and workers it spawned) with PR_SET_PDEATHSIG,
  so a killed parent (a Ray actor, the driver) cannot leave a server holding a GPU or a port;
- wait until healthy, and on failure say why with the exit code and the tail of the child's log;
- stop with SIGTERM to the whole group, then SIGKILL after a grace period.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import IO, TypeVar

import psutil

logger = logging.getLogger(__name__)
T = TypeVar("T")

STOP_GRACE_S = 5.0
PORT_ATTEMPTS = 3
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """`preexec_fn`: own session (process group), and SIGTERM when the launching process dies (Linux)."""
    os.setsid()
    _parent_death_signal(signal.SIGTERM)


def _parent_death_signal(sig: int) -> None:
    """`sig` to this process when the thread that started it ends (Linux; elsewhere nothing)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)


_forks_die = False
_forking_pid = 0  # set in the parent just before each fork; the child compares its parent with it


def _note_forking_pid() -> None:
    global _forking_pid
    _forking_pid = os.getpid()


def _die_with_forking_process() -> None:
    _parent_death_signal(signal.SIGKILL)
    if os.getppid() != _forking_pid:  # the parent died before the signal was armed: it would never come
        os.kill(os.getpid(), signal.SIGKILL)


def forks_die_with_this_process() -> None:
    """Every process this one forks from now on is killed when this one dies (once per process; idempotent).

    Why: megatron's checkpoint writer forks helper processes from the train actor; when the actor is killed in the
    middle of a save (a preempted job, `--save` under a kill), those forks were left behind for good, blocked on
    a lock their dead parent held (seen after the kill-during-save test: an orphan `ray::TrainRayActor.save`).
    SIGKILL, not SIGTERM: a fork inherits the actor's Python signal handlers, which need the dead parent.
    Linux ties the signal to the forking thread: a fork made from a short-lived thread would die with that thread,
    so this is for processes that fork from long-lived threads (a Ray actor runs its methods on its main thread)."""
    global _forks_die
    if not _forks_die:
        os.register_at_fork(before=_note_forking_pid, after_in_child=_die_with_forking_process)
        _forks_die = True


def port_is_free(port: int) -> bool:
    """Nothing listens on `port` (any local address) right now."""
    return not any(
        c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port for c in psutil.net_connections("tcp")
    )


def port_conflict(err: BaseException) -> bool:
    """Did a child fail because its port was taken (its log tail, carried in the error, says so)?"""
    text = str(err).lower()
    return "address already in use" in text or "errno 98" in text or "addrinuse" in text


def start_with_free_port(start: Callable[[], T], what: str, attempts: int = PORT_ATTEMPTS) -> T:
    """`start()` — which picks its own free port(s) each call — again when its child lost a port race.

    Why: a free port is chosen, then the child binds it; in between another process on the machine (a second
    test worker, another job) can take it. The loser exits with "address already in use"; a fresh pick wins."""
    for attempt in range(1, attempts + 1):
        try:
            return start()
        except (RuntimeError, TimeoutError) as e:
            if attempt == attempts or not port_conflict(e):
                raise
            logger.warning(
                "%s: port taken before the child bound it; retrying on another (%d/%d)", what, attempt, attempts
            )
    raise AssertionError("unreachable")


def log_tail(path: str | None, lines: int = 20) -> str:
    """The last `lines` lines of a child's log, formatted to end an error message ('' when there is none)."""
    if not path or not os.path.exists(path):
        return ""
    with open(path, errors="replace") as f:
        tail = f.readlines()[-lines:]
    return f"\n--- last {len(tail)} lines of {path} ---\n" + "".join(tail)


def signal_group(pgid: int, sig: int) -> bool:
    """Send `sig` to a process group; False when the group is gone (or not ours to signal)."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def stop_popen(proc: subprocess.Popen, grace: float = STOP_GRACE_S) -> int | None:
    """SIGTERM the child's group, SIGKILL it after `grace` seconds; returns the exit code."""
    if proc.poll() is None and signal_group(proc.pid, signal.SIGTERM):
        try:
            return proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    signal_group(proc.pid, signal.SIGKILL)  # also what the child left running in its group
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=STOP_GRACE_S)
    return proc.returncode


async def _exited(proc: asyncio.subprocess.Process, timeout: float) -> bool:
    # Polls the return code: `proc.wait()` also waits for the pipes, which a grandchild may hold open.
    deadline = time.monotonic() + timeout
    while proc.returncode is None:
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


async def wait_exited(proc: asyncio.subprocess.Process, timeout: float) -> bool:
    """Whether an asyncio child exited within `timeout` seconds (its pipes may still be open)."""
    return await _exited(proc, timeout)


async def stop_async(proc: asyncio.subprocess.Process, grace: float = STOP_GRACE_S) -> int | None:
    """`stop_popen` for an asyncio child: SIGTERM the group, SIGKILL after `grace`, always SIGKILL leftovers."""
    if proc.returncode is None and signal_group(proc.pid, signal.SIGTERM):
        await _exited(proc, grace)
    signal_group(proc.pid, signal.SIGKILL)
    await _exited(proc, STOP_GRACE_S)
    return proc.returncode


class ManagedProcess:
    """A supervised child: `start` it, `wait_healthy`, `stop` it. Output goes to `log_path` (or is dropped)."""

    def __init__(self, proc: subprocess.Popen, name: str, log_path: str | None) -> None:
        self.proc = proc
        self.name = name
        self.log_path = log_path

    @classmethod
    def start(
        cls,
        argv: Sequence[str],
        *,
        name: str,
        log_path: str | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
    ) -> ManagedProcess:
        out: IO[bytes] | int = subprocess.DEVNULL
        if log_path:
            os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
            out = open(log_path, "ab")  # noqa: SIM115 - the child writes to it for its lifetime
        logger.info("%s: %s%s", name, " ".join(argv), f" (log {log_path})" if log_path else "")
        try:
            proc = subprocess.Popen(
                list(argv),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=cwd,
                preexec_fn=die_with_parent,
            )
        finally:
            if not isinstance(out, int):
                out.close()  # the child holds its own descriptor
        return cls(proc, name, log_path)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def wait_healthy(
        self,
        probe: str | Callable[[], bool],
        timeout: float,
        interval: float = 0.2,
        request_timeout: float = 30.0,
        port: int | None = None,
    ) -> None:
        """Poll `probe` (a URL answering 200, or a callable) until it succeeds. Raises RuntimeError at once if
        the child exits, TimeoutError after `timeout`; both end with the child's log tail. A child that does not
        become healthy is stopped. With `port`, a healthy answer counts only once the child (or a descendant)
        listens there: a free port can be taken by another process between choosing it and binding it, and
        that process's health answer must not pass for ours."""
        check = _url_probe(probe, request_timeout) if isinstance(probe, str) else probe
        deadline = time.monotonic() + timeout
        try:
            while True:
                if self.proc.poll() is not None:
                    taken = f" (port {port}: address already in use)" if port and not port_is_free(port) else ""
                    raise RuntimeError(
                        f"{self.name} exited with code {self.proc.returncode} during start-up{taken}"
                        f"{log_tail(self.log_path)}"
                    )
                if check() and (port is None or self._listens_on(port)):
                    return
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"{self.name} not healthy after {timeout:.0f}s{log_tail(self.log_path)}")
                time.sleep(interval)
        except BaseException:
            self.stop()
            raise

    def _listens_on(self, port: int) -> bool:
        try:
            root = psutil.Process(self.proc.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return False
        for p in procs:
            try:
                conns = p.net_connections(kind="inet")
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            if any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port for c in conns):
                return True
        return False

    def stop(self, grace: float = STOP_GRACE_S) -> int | None:
        return stop_popen(self.proc, grace)

    def kill(self) -> None:
        """SIGKILL the whole group now (fault injection, a dead engine taken out)."""
        signal_group(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=STOP_GRACE_S)


def _url_probe(url: str, request_timeout: float) -> Callable[[], bool]:
    import httpx  # here: most importers of this module never probe a URL

    def check() -> bool:
        try:
            return httpx.get(url, timeout=request_timeout).status_code == 200
        except httpx.HTTPError:
            return False

    return check
