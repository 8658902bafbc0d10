"""Fault injection for tests and `bench/faults.py`: kill, exit, crash or hang one actor kind at one point of a run.

Driven by one environment variable, read once per process (Ray actors inherit the driver's environment), so a
run without it pays one cached falsy check per point::

    SLIME_FAULT=KIND:FAULT:POINT[:NTH][,KIND:FAULT:POINT[:NTH]...]

- KIND: who faults: `train` (an actor train rank), `critic` (a critic rank), `rollout_manager`, `engine` (engine
  0's server process), `router`. A process calls `inject(kind, point)` with its own kind, so a spec fires only
  there. (The agent gateway and the coding sandbox call no injection point yet: their kinds are refused rather
  than accepted and never fired.)
- FAULT: `sigkill` (SIGKILL to itself), `exit` (`os._exit(1)`: no clean-up, no exception), `segfault` (a read of
  address 0), `deadlock` (a thread that holds a lock waits for it forever: the process lives, answers nothing).
- POINT: `rollout`, `train_step`, `weight_sync`, `save` (where a kind calls `inject`: mid-rollout, mid-train-step,
  mid-weight-sync, mid-save).
- NTH: fire on the NTH time this process reaches the point (default 1).

A process slime runs no Python in (the Rust router, an engine binary) faults from the process that drives it:
`signal_fault(kind, point, pid)` delivers the fault as a signal (SIGKILL; `exit` as SIGTERM; SIGSEGV; `deadlock`
as SIGSTOP, which freezes it as a hang would).

`SLIME_FAULT_MARKER=PATH` makes a spec fire once per job, not once per process: the first process to fire creates
PATH exclusively (and writes where and when it fired), every later one — a restarted run inherits the variable —
finds it and goes on. The bench reads the marker to know the fault did happen.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)

ENV = "SLIME_FAULT"
MARKER_ENV = "SLIME_FAULT_MARKER"
KINDS = ("train", "critic", "rollout_manager", "engine", "router")
FAULTS = ("sigkill", "exit", "segfault", "deadlock")
POINTS = ("rollout", "train_step", "weight_sync", "save")
EXTERNAL_SIGNALS = {"sigkill": signal.SIGKILL, "exit": signal.SIGTERM, "segfault": signal.SIGSEGV}


@dataclass(frozen=True)
class FaultSpec:
    kind: str
    fault: str
    point: str
    nth: int = 1

    def __str__(self) -> str:
        return f"{self.kind}:{self.fault}:{self.point}:{self.nth}"


def parse_specs(text: str) -> list[FaultSpec]:
    """`KIND:FAULT:POINT[:NTH]`, comma-separated; a ValueError names what is wrong."""
    specs = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        parts = item.split(":")
        if len(parts) not in (3, 4):
            raise ValueError(f"{ENV}={text!r}: expected KIND:FAULT:POINT[:NTH], got {item!r}")
        kind, fault, point = parts[:3]
        for value, allowed, what in ((kind, KINDS, "kind"), (fault, FAULTS, "fault"), (point, POINTS, "point")):
            if value not in allowed:
                raise ValueError(f"{ENV}: unknown {what} {value!r} (one of {', '.join(allowed)})")
        nth = parts[3] if len(parts) == 4 else "1"
        if not nth.isdigit() or int(nth) < 1:
            raise ValueError(f"{ENV}: NTH must be an integer >= 1, got {nth!r}")
        specs.append(FaultSpec(kind, fault, point, int(nth)))
    return specs


_specs: list[FaultSpec] | None = None  # parsed on the first call; [] when the variable is unset
_seen: dict[tuple[str, str], int] = {}


def active_specs() -> list[FaultSpec]:
    global _specs
    if _specs is None:
        _specs = parse_specs(os.environ.get(ENV, ""))
    return _specs


def reset() -> None:
    """Forget the parsed variable and the counts (tests that change the environment)."""
    global _specs
    _specs = None
    _seen.clear()


def _due(kind: str, point: str) -> FaultSpec | None:
    specs = active_specs()
    if not specs:
        return None
    matching = [s for s in specs if s.kind == kind and s.point == point]
    if not matching:
        return None
    n = _seen[(kind, point)] = _seen.get((kind, point), 0) + 1
    for spec in matching:
        if spec.nth == n and _claim(spec):
            return spec
    return None


def _claim(spec: FaultSpec) -> bool:
    """True when this process may fire `spec`: no marker asked for, or this process created it first."""
    path = os.environ.get(MARKER_ENV)
    if not path:
        return True
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        json.dump({"spec": str(spec), "pid": os.getpid(), "time": time.time()}, f)
    return True


def enabled() -> bool:
    """Whether any fault is asked for in this process (callers skip their own set-up when not)."""
    return bool(active_specs())


def inject(kind: str, point: str) -> None:
    """Fault here if `SLIME_FAULT` asks for `kind` at `point` (this process's NTH time here); else return at once."""
    if _specs == []:  # the off path: one comparison once the variable has been read
        return
    spec = _due(kind, point)
    if spec is not None:
        fire(spec.fault, f"{spec}")


def fire(fault: str, what: str) -> None:
    """Perform `fault` in this process (never returns)."""
    logger.warning("fault injection: %s in pid %d", what, os.getpid())
    for handler in logging.getLogger().handlers:
        handler.flush()  # the line above must reach the actor's log before the process goes
    if fault == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault == "exit":
        os._exit(1)
    elif fault == "segfault":
        ctypes.string_at(0)
    elif fault == "deadlock":
        lock = threading.Lock()
        lock.acquire()
        lock.acquire()  # never returns: this thread waits for the lock it holds
    raise ValueError(f"unknown fault {fault!r}")


def signal_fault(kind: str, point: str, pid: int | None) -> bool:
    """For a process that runs no slime code (`kind` router, engine binaries): deliver the due fault to `pid` as a
    signal from here; True when one was sent."""
    if _specs == [] or pid is None:
        return False
    spec = _due(kind, point)
    if spec is None:
        return False
    sig = EXTERNAL_SIGNALS.get(spec.fault, signal.SIGSTOP)
    logger.warning("fault injection: %s -> signal %s to pid %d", spec, signal.Signals(sig).name, pid)
    os.kill(pid, sig)
    return True
