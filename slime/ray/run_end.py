"""How every `slime train` run ends, however it ends: engines and routers disposed, metrics flushed, Ray stopped."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
from argparse import Namespace
from typing import Any

import ray

logger = logging.getLogger(__name__)


def shut_down(manager: Any, tracker: Any) -> None:
    """End of every run, however it ends: engines and routers disposed, metrics flushed, Ray stopped."""
    if manager is not None:
        try:
            ray.get(manager.dispose.remote(), timeout=120)
        except Exception:  # noqa: BLE001 - shutting down anyway
            logger.warning("rollout manager dispose failed", exc_info=True)
    tracker.close()
    stop_autoscaler_monitor()
    ray.shutdown()


def stop_autoscaler_monitor() -> None:
    """SIGKILL the autoscaler monitor of the Ray cluster this driver started, just before `ray.shutdown()`.

    Why: Ray's shut-down stops the GCS first and then SIGTERMs the monitor, whose handler tries to report its own
    termination to that GCS; `ray.shutdown()` waits 1 s for it and then SIGKILLs it anyway, so every run ended
    1 s later. The monitor of a single-node cluster holds nothing to save. Its handle is Ray's private state: where
    it is not what Ray 2.60 has (or this driver joined a cluster, so started no monitor), Ray stops it as before."""
    try:
        from ray._private import ray_constants, worker

        infos = list(worker._global_node.all_processes.get(ray_constants.PROCESS_TYPE_MONITOR, []))
    except (ImportError, AttributeError):
        return
    for info in infos:
        with contextlib.suppress(OSError, AttributeError, subprocess.TimeoutExpired):
            info.process.kill()
            info.process.wait(timeout=5)


def write_summary(args: Namespace, summary: dict) -> str:
    """METRICS_DIR/summary.json: what scripts and tests read after the run."""
    path = os.path.join(args.metrics_dir, "summary.json")
    with open(path, "w") as f:
        json.dump(summary, f, indent=1, default=str)
    return path
