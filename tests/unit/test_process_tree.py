"""ProcessTreeWatcher counts what a run launched, not the transient forks those processes make."""

import subprocess
import sys
import time

import pytest

from sim.process_tree import ProcessTreeWatcher

pytestmark = pytest.mark.cpu

# The parent starts two "engines"; the first forks a child that never execs (what `subprocess` does for an instant
# before exec), so that child carries the engine's cmdline for as long as it lives.
ENGINE = "import os, sys, time; pid = os.fork() if sys.argv[1] == 'forks' else 1; time.sleep(1.5); pid or os._exit(0)"
PARENT = f"""
import subprocess, sys
marker = 'fake_engine_' + 'marker'  # not spelt out, or the parent's own cmdline would match
procs = [subprocess.Popen([sys.executable, '-c', {ENGINE!r}, mode, marker]) for mode in ('forks', 'plain')]
[p.wait() for p in procs]
"""


def test_count_skips_forked_children_of_a_match():
    parent = subprocess.Popen([sys.executable, "-c", PARENT])
    watcher = ProcessTreeWatcher(parent.pid, interval=0.05)
    try:
        deadline = time.monotonic() + 10
        while len(watcher.cmdlines) < 4 and time.monotonic() < deadline:  # parent, two engines, one fork
            time.sleep(0.05)
        time.sleep(0.3)
    finally:
        parent.wait(timeout=20)
        watcher.stop()
    raw = sum("fake_engine_marker" in c for c in watcher.cmdlines.values())
    assert raw == 3  # the fork was seen with its parent's cmdline ...
    assert watcher.count("fake_engine_marker") == 2  # ... and is not counted as a third engine
