"""The cyclic garbage collector's thresholds for the process that holds the rollouts (the RolloutManager).

Why: with the default thresholds (700, 10, 10) a collection runs every 700 net allocations, and the older
generations it promotes into are scanned again and again while tens of thousands of samples (each a few
lists, dicts and asyncio futures) are alive. Measured in the scheduling simulator with slime's real producer,
buffer and loop (bench/orchestration_scale.py, docs/performance.md#orchestration-at-scale): the driver's CPU per
sample doubled from 1k to 10k samples per step with the defaults and stayed flat with the collector off, so the
growth was the collector's, not slime's code. Raising the first threshold keeps collections (asyncio makes
reference cycles, which only the collector frees) but makes each one pay for far more allocations.
"""

from __future__ import annotations

import gc
import logging

logger = logging.getLogger(__name__)

ROLLOUT_THRESHOLDS = (50_000, 20, 100)


def relax_gc_for_rollouts() -> tuple[int, int, int]:
    """Set the thresholds above; returns the previous ones."""
    before = gc.get_threshold()
    gc.set_threshold(*ROLLOUT_THRESHOLDS)
    logger.debug("gc thresholds %s -> %s", before, ROLLOUT_THRESHOLDS)
    return before
