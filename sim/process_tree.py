"""`ProcessTreeWatcher`: what a running command really started, seen from outside with psutil.

Tests use it to prove which processes a run launched (engines, routers) and which ports they listened on,
instead of trusting a mocked launcher or the run's own report.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import psutil


class ProcessTreeWatcher:
    """Samples every descendant's cmdline, process name, parent, CPU time (and listening ports) until `stop()`."""

    def __init__(self, pid: int, interval: float = 0.2, listeners: bool = False) -> None:
        """`listeners=True` also records each process's listening ports: that reads every socket table of the
        machine per process and sample (most of the watcher's CPU), so only tests that check ports ask for it."""
        self.root = psutil.Process(pid)
        self.watch_ports = listeners
        self.interval = interval
        self.cmdlines: dict[int, str] = {}
        self.names: dict[int, str] = {}
        self.parents: dict[int, int] = {}
        self.cpu_s: dict[int, float] = {}  # user + system, as last sampled (a process's total, near its exit)
        self.first_seen_s: dict[int, float] = {}  # seconds after the watcher started
        self._t0 = time.perf_counter()
        self.listeners: dict[int, set[int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                procs = [self.root, *self.root.children(recursive=True)]
            except psutil.Error:
                return
            for p in procs:
                try:
                    with p.oneshot():  # one read of /proc/PID/stat for name, parent and CPU times
                        self._sample(p)
                except psutil.Error:
                    pass
            time.sleep(self.interval)

    def _sample(self, p: psutil.Process) -> None:
        cmd = " ".join(p.cmdline())
        if cmd:  # a zombie's cmdline reads empty: keep what the live process showed
            self.cmdlines[p.pid] = cmd
        self.names[p.pid] = p.name()  # e.g. sglang_router retitles itself "sglang::router"
        self.parents[p.pid] = p.ppid()
        cpu = p.cpu_times()
        self.cpu_s[p.pid] = cpu.user + cpu.system
        self.first_seen_s.setdefault(p.pid, time.perf_counter() - self._t0)
        if self.watch_ports:
            ports = {c.laddr.port for c in p.net_connections("inet") if c.status == psutil.CONN_LISTEN}
            self.listeners.setdefault(p.pid, set()).update(ports)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def count(self, needle: str) -> int:
        """Processes whose cmdline or name contains `needle`, not counting a match's own children.

        A child forked by a matching process shows its parent's cmdline until it execs (an engine that runs
        `ldconfig` through `subprocess` is seen twice if the sample lands in that window), so only the outermost
        match of each subtree counts.
        """
        hits = {pid for pid, c in self.cmdlines.items() if needle in c or needle in self.names.get(pid, "")}
        return sum(self.parents.get(pid) not in hits for pid in hits)


def sandbox_processes(root: Path) -> list[str]:
    """Command lines of the live processes of the local sandboxes under `root` (slime/agent/local_sandbox.py).

    A sandbox uid alone does not say whose a process is: tests on the other worker run sandboxes with the same
    uids at the same time. So a process counts when its uid is a sandbox uid and its HOME or TMPDIR lies under
    `root`, or when its environment cannot be read (counted, as if it were ours)."""
    from slime.agent.local_sandbox import UID_BASE, UID_SLOTS

    out = []
    for p in psutil.process_iter(["uids", "cmdline", "status"]):
        if p.info["status"] == psutil.STATUS_ZOMBIE:  # dead, not yet reaped by this host's pid 1
            continue
        uids = p.info["uids"]
        if uids is None or not UID_BASE <= uids.real < UID_BASE + UID_SLOTS:
            continue
        try:
            env = p.environ()
        except psutil.NoSuchProcess:
            continue
        except psutil.AccessDenied:
            env = {}
        if not env or any(env.get(k, "").startswith(str(root)) for k in ("HOME", "TMPDIR")):
            out.append(" ".join(p.info["cmdline"] or []))
    return out
