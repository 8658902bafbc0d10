"""The RolloutManager's collector thresholds (slime/utils/gc_policy.py)."""

from __future__ import annotations

import gc

import pytest

from slime.utils.gc_policy import ROLLOUT_THRESHOLDS, relax_gc_for_rollouts

pytestmark = pytest.mark.cpu


def test_the_rollout_process_relaxes_the_collector_and_says_what_it_had() -> None:
    before = gc.get_threshold()
    try:
        assert relax_gc_for_rollouts() == before
        assert gc.get_threshold() == ROLLOUT_THRESHOLDS
    finally:
        gc.set_threshold(*before)
