"""`--max-restarts N`: the job restarted from its newest complete checkpoint after a dead or hung actor.

The supervisor runs each attempt as a **fresh driver process** (`python -m slime.cli train ARGV --max-restarts 0`,
plus `--load <the --save dir>` once that holds a complete checkpoint), not in-process, because:

- a fresh process is exactly the resume-by-hand path the resume tests already prove (no prompt skipped or
  repeated; data source, carried-over groups, pending and in-flight groups restored), so a restart inherits
  those guarantees instead of needing its own;
- a hung actor leaves driver threads blocked in Ray calls that cannot be cancelled, and a dying driver can leave
  module state, event loops and a half-stopped Ray cluster behind; a new process and a new Ray cluster start
  clean, and whatever the old attempt left in its process group is killed before the next one starts;
- the supervisor imports neither Ray nor torch and runs no actor code, so it survives what kills a driver (a
  segfault in a native library, the OOM killer) and still restarts.

The price is a second Ray start-up per restart (seconds on one node), small next to the work a restart saves.

Each attempt that ends in a fault leaves METRICS_DIR/fault.json (`slime/ray/actor_faults.py`); the supervisor
moves it to METRICS_DIR/restarts/attempt_K.json and decides (`decide`, pure): restart after a dead or hung actor
(or a driver killed by a signal) while restarts are left; stop on success, on a user error, on an interrupt and
on an actor's own Python exception (a restart would repeat it). The last attempt's exit code is the job's.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import signal
import subprocess
import sys
from argparse import Namespace
from dataclasses import dataclass
from typing import Any

from slime.ray.actor_faults import FAULT_FILE, RESTARTABLE, read_fault
from slime.utils import checkpoint_dirs
from slime.utils.atomic import atomic_open
from slime.utils.process import die_with_parent, stop_popen

logger = logging.getLogger(__name__)

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_FAULT, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


@dataclass(frozen=True)
class Decision:
    restart: bool
    reason: str


def decide(rc: int, fault: dict[str, Any] | None, restarts_done: int, max_restarts: int) -> Decision:
    """Whether the job restarts after an attempt that exited with `rc` (negative: killed by that signal) and left
    `fault` (its fault.json, or None)."""
    if rc == EXIT_OK:
        return Decision(False, "finished")
    if rc in (EXIT_USAGE, EXIT_INTERRUPTED, -signal.SIGINT):
        return Decision(False, "stopped: a user error or an interrupt is not a fault")
    if fault is not None and fault.get("fault") in RESTARTABLE:
        what = f"{fault.get('actor')} {fault.get('fault')}"
    elif rc < 0:
        what = f"the driver was killed by {signal.Signals(-rc).name}"
    else:
        return Decision(False, f"stopped: the run failed with exit code {rc}, not by an actor fault")
    if restarts_done >= max_restarts:
        return Decision(False, f"{what}; no restart left (--max-restarts {max_restarts})")
    return Decision(True, f"{what}; restart {restarts_done + 1} of {max_restarts}")


def attempt_argv(argv: list[str], save_root: str | None) -> list[str]:
    """An attempt's command line: the user's, never supervised again, resuming from `save_root` once it holds a
    complete checkpoint (before that, the user's own --load, if any, still applies). argparse keeps the last value."""
    out = [*argv, "--max-restarts", "0"]
    if save_root and checkpoint_dirs.find_checkpoint(save_root) is not None:
        out += ["--load", save_root]
    return out


def _run_attempt(argv: list[str]) -> int:
    """One driver process in its own process group; whatever it left in that group is stopped after it ends."""
    proc = subprocess.Popen([sys.executable, "-m", "slime.cli", "train", *argv], preexec_fn=die_with_parent)
    try:
        rc = proc.wait()
    except KeyboardInterrupt:
        stop_popen(proc)
        return EXIT_INTERRUPTED
    stop_popen(proc)  # the group's leftovers (a killed driver's Ray daemons, engines)
    return rc


def _keep_fault(metrics_dir: str, attempt: int) -> dict[str, Any] | None:
    """Move the attempt's fault.json aside (the next attempt writes its own); returns it."""
    fault = read_fault(metrics_dir)
    if fault is not None:
        os.makedirs(os.path.join(metrics_dir, "restarts"), exist_ok=True)
        with atomic_open(os.path.join(metrics_dir, "restarts", f"attempt_{attempt}.json")) as f:
            json.dump(fault, f)
        os.remove(os.path.join(metrics_dir, FAULT_FILE))
    return fault


def supervise(argv: list[str], args: Namespace) -> int:
    """Run `slime train ARGV` with up to `args.max_restarts` restarts; returns the exit code of the last attempt."""
    from slime.backends.megatron.roles import role_args

    save_root = role_args(args, "actor").save
    metrics_dir = args.metrics_dir
    for stale in glob.glob(os.path.join(metrics_dir, "restarts", "attempt_*.json")):
        os.remove(stale)  # a new job in an old metrics dir: only this job's restarts are listed
    history: list[dict[str, Any]] = []
    attempt = 0
    while True:
        rc = _run_attempt(attempt_argv(argv, save_root) if attempt else [*argv, "--max-restarts", "0"])
        fault = _keep_fault(metrics_dir, attempt)
        decision = decide(rc, fault, attempt, args.max_restarts)
        history.append({"attempt": attempt, "rc": rc, "fault": fault, "decision": decision.reason})
        if not decision.restart:
            break
        logger.warning("%s", decision.reason)
        attempt += 1
    _record(metrics_dir, history)
    if rc != EXIT_OK and attempt:
        logger.error("%s", decision.reason)
    return rc


def _record(metrics_dir: str, history: list[dict[str, Any]]) -> None:
    """METRICS_DIR/restarts.json: every attempt's exit code, fault and what the supervisor decided."""
    os.makedirs(metrics_dir, exist_ok=True)
    with open(os.path.join(metrics_dir, "restarts.json"), "w") as f:
        json.dump({"attempts": history, "restarts": len(history) - 1}, f, indent=1)
