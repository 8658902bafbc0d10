"""Scheduling invariants over random latency traces and schedules, through the scheduling simulator (slime's real
loop driver, rollout functions, fully-async producer, buffer and staleness filter on simulated engines):

- every prompt handed out is trained exactly once, dropped and counted, or still in the run at the end;
- no consumed group exceeds the staleness bound;
- weight versions never decrease along a trajectory;
- the buffer never holds more than its capacity;
- two runs with one seed are identical.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.scheduling.run import SIM_MODES, SimConfig, simulate
from sim.workloads.long_tail import Workload
from slime.scheduling.arguments import inherent_staleness

pytestmark = pytest.mark.cpu


@st.composite
def cases(draw):
    w = Workload(
        seed=draw(st.integers(0, 10**6)),
        response_median=draw(st.floats(1.0, 30.0)),
        response_sigma=draw(st.floats(0.0, 1.5)),
        response_min=1,
        max_new_tokens=draw(st.integers(2, 60)),
        prompt_median=draw(st.floats(1.0, 20.0)),
        prompt_min=1,
        prompt_max=40,
        engines=draw(st.integers(1, 3)),
        slots_per_engine=draw(st.integers(1, 4)),
        decode_step_s=draw(st.floats(0.001, 0.1)),
        decode_step_per_request_s=draw(st.floats(0.0, 0.01)),
        prefill_per_token_s=draw(st.floats(0.0, 0.002)),
        rollout_batch_size=draw(st.integers(1, 3)),
        n_samples_per_prompt=draw(st.integers(1, 3)),
        train_step_s=draw(st.floats(0.01, 3.0)),
        train_per_token_s=draw(st.floats(0.0, 0.01)),
        weight_sync_s=draw(st.floats(0.0, 2.0)),
    )
    mode = draw(st.sampled_from(SIM_MODES))
    interval = draw(st.integers(1, 3))
    floor = inherent_staleness("sync" if mode == "partial" else mode, interval)
    k = draw(st.one_of(st.none(), st.integers(floor, floor + 2)))
    n = w.n_samples_per_prompt
    c = SimConfig(
        mode=mode,
        max_staleness=k,
        unused_handler=draw(st.sampled_from(["retry", "drop"])),
        update_weights_interval=interval,
        buffer_capacity_factor=draw(st.sampled_from([1.0, 1.5, 2.0, 3.0])),
        max_concurrent_samples=draw(st.integers(n, 4 * w.engines * w.slots_per_engine + n)),
        over_sampling=draw(st.sampled_from([1.0, 1.5, 2.0])),
        mask_offpolicy=draw(st.booleans()) and mode in ("fully_async", "partial"),
        max_steps=draw(st.integers(1, 5)),
        custom_buffer_path=draw(st.sampled_from([None, "sim.scheduling.buffers.NewestFirstBuffer"])),
    )
    return w, c


@settings(deadline=None)
@given(cases())
def test_scheduling_invariants(case):
    w, c = case
    r = simulate(c, w)
    assert r.steps == c.max_steps
    consumed = [x.prompt_index for x in r.consumed]
    # trained exactly once, dropped and counted, or still in the run
    assert len(consumed) == len(set(consumed)), Counter(consumed).most_common(3)
    if c.mode == "fully_async":  # every step gets a full batch; the others may train fewer after drops
        assert len(consumed) == c.max_steps * w.rollout_batch_size
    dropped, outstanding = set(r.dropped_ids), set(r.outstanding_ids)
    assert len(r.dropped_ids) == len(dropped) == r.stale_dropped
    assert len(r.outstanding_ids) == len(outstanding)
    assert not (set(consumed) & dropped) and not (set(consumed) & outstanding) and not (dropped & outstanding)
    assert set(consumed) | dropped | outstanding == set(range(r.handed_out))
    for x in r.consumed:
        assert x.samples == w.n_samples_per_prompt
        if c.max_staleness is not None:
            assert x.staleness <= c.max_staleness
        for versions in x.span_versions:  # along a trajectory, answers come from ever newer (or equal) weights
            assert versions == sorted(versions)
    assert r.max_buffer <= r.buffer_capacity
    # one seed, one run
    again = simulate(c, w)
    assert again.events == r.events and again.consumed == r.consumed and again.report() == r.report()


@settings(deadline=None)
@given(cases(), st.integers(1, 3), st.floats(0.0, 1.0))
def test_killed_anywhere_and_resumed_loses_and_repeats_no_prompt(case, save_interval, kill_fraction):
    """Kill a run at a random moment (groups in flight, buffered, a rollout generated ahead), resume from its last
    checkpoint: over the checkpointed part and the resumed run, no prompt is trained twice, and every prompt
    handed out is trained, dropped and counted, or still in the run."""
    w, c = case
    c = dataclasses.replace(c, save_interval=save_interval)
    whole = simulate(c, w)
    killed = simulate(dataclasses.replace(c, kill_at_s=kill_fraction * whole.sim_time_s), w)
    assert killed.killed or kill_fraction == 1.0
    last = max(killed.checkpoints) if killed.checkpoints else None
    resumed = simulate(c, w, resume=killed.checkpoints[last] if last is not None else None)
    assert resumed.steps == c.max_steps - (last + 1 if last is not None else 0)
    consumed = resumed.consumed_before + [x.prompt_index for x in resumed.consumed]
    assert len(consumed) == len(set(consumed)), "a prompt trained twice across the resume"
    dropped, outstanding = set(resumed.dropped_ids), set(resumed.outstanding_ids)
    assert len(resumed.dropped_ids) == len(dropped)
    assert not (set(consumed) & dropped) and not (set(consumed) & outstanding) and not (dropped & outstanding)
    assert set(consumed) | dropped | outstanding == set(range(resumed.handed_out)), "a prompt was lost"
    if c.mode == "fully_async":
        assert len(consumed) == c.max_steps * w.rollout_batch_size
