"""`shut_down` SIGKILLs the autoscaler monitor of the cluster the driver started before `ray.shutdown()`, which would
SIGTERM it after the GCS is gone and wait a second for it (slime/ray/run_end.py); other processes are Ray's to stop."""

from __future__ import annotations

import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest
from ray._private import ray_constants, worker

from slime.ray.run_end import stop_autoscaler_monitor

pytestmark = pytest.mark.cpu

# a process that, like Ray's monitor with its GCS gone, does not end on SIGTERM
STUBBORN = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"
)


def _stubborn() -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", STUBBORN], stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == b"up\n"  # its SIGTERM handler is in place
    return proc


def test_the_monitor_is_killed_and_nothing_else(monkeypatch):
    monitor, raylet = _stubborn(), _stubborn()
    try:
        processes = {
            ray_constants.PROCESS_TYPE_MONITOR: [SimpleNamespace(process=monitor)],
            ray_constants.PROCESS_TYPE_RAYLET: [SimpleNamespace(process=raylet)],
        }
        monkeypatch.setattr(worker, "_global_node", SimpleNamespace(all_processes=processes))
        stop_autoscaler_monitor()
        assert monitor.poll() == -signal.SIGKILL
        assert raylet.poll() is None
    finally:
        for p in (monitor, raylet):
            p.kill()
            p.wait()


def test_without_a_cluster_it_does_nothing(monkeypatch):
    monkeypatch.setattr(worker, "_global_node", None)
    stop_autoscaler_monitor()  # no error: ray.shutdown() then has nothing to stop either
