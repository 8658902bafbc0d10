"""How every `slime train` run ends, synchronous or async: one place, so a change to shut-down applies to both."""

from __future__ import annotations

import json
import logging
import os
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
    ray.shutdown()


def write_summary(args: Namespace, summary: dict) -> str:
    """METRICS_DIR/summary.json: what scripts and tests read after the run."""
    path = os.path.join(args.metrics_dir, "summary.json")
    with open(path, "w") as f:
        json.dump(summary, f, indent=1, default=str)
    return path
