"""How every `slime train` run starts: servers and trainer up, and where the time went.

Start-up is a fixed cost every run pays before its first step (on a 2-core laptop it dwarfs a toy step), so
what does not depend on something else runs side by side: the train actors build their models while the
engines load theirs — unless they share GPUs (colocated), where the trainer must wait for the engines to
release their memory first. (The prompt files are still checked before Ray starts: a typo costs a second.)
"""

from __future__ import annotations

import json
import logging
import os
import time
from argparse import Namespace
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import ray

logger = logging.getLogger(__name__)
T = TypeVar("T")


def servers_and_trainer(
    args: Namespace, manager: Any, build_trainer: Callable[[], T]
) -> tuple[dict[str, Any], T, dict[str, float]]:
    """Wait for the rollout manager's servers and build the trainer; returns (server info, trainer, timings).

    Disaggregated runs overlap the two (`startup/rollout_servers` and `startup/trainer_init` then both count from
    the same moment); colocated ones go servers → engines offloaded → trainer, as their GPU memory requires."""
    t0 = time.perf_counter()
    timings: dict[str, float] = {}
    if args.colocate or args.offload_rollout:
        info = ray.get(manager.server_info.remote())
        timings["startup/rollout_servers"] = time.perf_counter() - t0
        _write_server_info(args, info)
        if args.offload_rollout:
            ray.get(manager.offload.remote())  # the trainer builds its model on the engines' GPUs next
        t1 = time.perf_counter()
        trainer = build_trainer()
        timings["startup/trainer_init"] = time.perf_counter() - t1
        return info, trainer, timings

    def timed_build() -> T:
        trainer = build_trainer()
        timings["startup/trainer_init"] = time.perf_counter() - t0
        return trainer

    pool = ThreadPoolExecutor(1, thread_name_prefix="trainer-init")
    try:
        built = pool.submit(timed_build)
        info = ray.get(manager.server_info.remote())
        timings["startup/rollout_servers"] = time.perf_counter() - t0
        _write_server_info(args, info)
        trainer = built.result()
    finally:
        # a server that failed to start is reported now, not after the model is built; the driver's shut-down
        # (ray.shutdown) then ends the build
        pool.shutdown(wait=False)
    return info, trainer, timings


def _write_server_info(args: Namespace, info: dict[str, Any]) -> None:
    os.makedirs(args.metrics_dir, exist_ok=True)
    with open(os.path.join(args.metrics_dir, "servers.json"), "w") as f:
        json.dump(info, f)  # lets operators (and tests) find the processes while running


def report_startup(tracker: Any, startup: dict[str, float], t_start: float, step: int) -> dict[str, float]:
    """Log the start-up phases once, as the `startup` metrics kind and one console line; returns them with the
    total (seconds from the driver's first check to the first rollout)."""
    from slime.utils.tracking import startup_line

    out = {**startup, "startup/total": time.perf_counter() - t_start}
    tracker.log(out, step=step, kind="startup")
    logger.info("started in %s", startup_line(out))
    return out
