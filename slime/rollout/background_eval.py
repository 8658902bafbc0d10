"""`--eval-interval` under `--fully-async`: an evaluation runs beside the producer and the trainer.

The RolloutManager is a Ray actor whose methods run one at a time, so an eval run inside one of them would hold
up the trainer's next `consume` for as long as it takes. Instead the eval runs on a thread of its own (the
rollout function blocks that thread while its requests run on the shared background loop, next to the
producer's) and the manager returns at once; its metrics are collected after a later step (`finished`).

One weight version: an eval starts between weight syncs (the loop calls it before a step's batch) and a weight
sync waits for a running eval to finish (`wait`) before it touches the engines, so every eval answer comes from
the version recorded as `eval/weight_version`. The trainer does not wait unless an eval outlasts a step.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


@dataclass
class _Eval:
    rollout_id: int
    weight_version: int | None
    future: concurrent.futures.Future


class BackgroundEval:
    """Evals in flight (one at a time, in order) and their results until collected."""

    def __init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="background-eval")
        self._evals: list[_Eval] = []

    def start(self, rollout_id: int, weight_version: int | None, fn: Callable[[], Any]) -> None:
        """Run `fn()` (the eval rollout function) in the background, for the eval before `rollout_id`."""
        logger.info("eval %d starts in the background at weight version %s", rollout_id, weight_version)
        self._evals.append(_Eval(rollout_id, weight_version, self._pool.submit(fn)))

    def wait(self) -> None:
        """Block until no eval runs (before a weight sync; results stay for `finished`). An eval's failure is
        raised by `finished`, where its metrics would have been."""
        concurrent.futures.wait([e.future for e in self._evals])

    @property
    def running(self) -> bool:
        return any(not e.future.done() for e in self._evals)

    def finished(self, wait: bool = False) -> list[tuple[int, int | None, Any]]:
        """(rollout id, weight version, the rollout function's output) of each eval done, oldest first; `wait`:
        every eval started so far."""
        if wait:
            self.wait()
        done = [e for e in self._evals if e.future.done()]
        self._evals = [e for e in self._evals if not e.future.done()]
        return [(e.rollout_id, e.weight_version, e.future.result()) for e in done]

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
