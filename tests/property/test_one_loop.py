"""The one loop (`slime/scheduling/loop.py`) for every schedule: the order of its events, what overlaps and what
never does, what it tells the trainer, and how it times a step; then the same order in the scheduling simulator.

A timed backend runs each event as a sleep of a drawn length on the simulator's virtual clock, so concurrency is
real (one-step-ahead's rollout runs while the step trains) and a whole run takes milliseconds. The order is held
against `tests/loop_order.py` (the documented order, written flat); the Ray runs check the same oracle end to end
(`tests/integration/test_resume.py`, `test_async_train.py`, `test_ppo_async.py`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.scheduling.clock import run_virtual
from slime.scheduling.loop import MODES, STEP_PHASES, LoopBackend, LoopPlan, run_loop
from tests.hypothesis_budget import examples
from tests.loop_order import expected_events

pytestmark = pytest.mark.cpu


@dataclass
class Call:
    kind: str
    ident: int
    start: float
    end: float = float("nan")
    keep_weights: bool | None = None  # train: the loop's promise that a weight sync follows
    engines: str | None = None  # train, sync: the colocated engines' state the call found


@dataclass
class TimedBackend(LoopBackend):
    """Every event a sleep of `durations[kind]` seconds; records each call's interval and the engines' state."""

    durations: dict[str, float]
    calls: list[Call] = field(default_factory=list)
    steps: dict[int, dict[str, float]] = field(default_factory=dict)
    engines: str = "serving"  # colocated: serving -> released -> weights -> serving

    async def _run(self, kind: str, ident: int, **extra: Any) -> None:
        call = Call(kind, ident, asyncio.get_running_loop().time(), **extra)
        self.calls.append(call)
        await asyncio.sleep(self.durations.get(kind, 0.0))
        call.end = asyncio.get_running_loop().time()

    async def evaluate(self, rollout_id: int) -> None:
        await self._run("eval", rollout_id)

    async def rollout(self, rollout_id: int) -> None:
        await self._run("rollout", rollout_id)

    async def train_data(self, rollout_id: int) -> Any:
        await self._run("train_data", rollout_id)
        return f"batch {rollout_id}"

    async def start_producer(self, rollout_id: int) -> None:
        await self._run("start_producer", rollout_id)

    async def consume(self, rollout_id: int) -> Any:
        await self._run("consume", rollout_id)
        return f"batch {rollout_id}"

    async def stop_producer(self) -> None:
        await self._run("stop_producer", -1)

    async def release_engines(self) -> None:
        assert self.engines == "serving"
        self.engines = "released"
        await self._run("release", -1)

    async def train(self, rollout_id: int, batch: Any, keep_weights: bool) -> None:
        assert batch in (f"batch {rollout_id}", None)
        await self._run("train", rollout_id, keep_weights=keep_weights, engines=self.engines)

    async def save(self, rollout_id: int) -> None:
        await self._run("save", rollout_id)

    async def save_hf(self, rollout_id: int) -> None:
        await self._run("save_hf", rollout_id)

    async def resume_engine_weights(self) -> None:
        assert self.engines == "released"
        self.engines = "weights"
        await self._run("resume_weights", -1)

    async def sync_weights(self, version: int) -> None:
        await self._run("sync", version, engines=self.engines)

    async def resume_engine_cache(self) -> None:
        assert self.engines == "weights"
        self.engines = "serving"
        await self._run("resume_cache", -1)

    async def step_done(self, rollout_id: int, times: dict[str, float]) -> None:
        self.steps[rollout_id] = times


@st.composite
def plans(draw: Any, colocated: bool = False) -> LoopPlan:
    """A loop plan; `colocated` draws only offloading (sync, not debug) ones, instead of filtering most away."""
    mode = "sync" if colocated else draw(st.sampled_from(MODES))
    num_rollout = draw(st.integers(1, 6))
    debug = not colocated and draw(st.booleans()) and mode == "sync"  # the async schedules refuse the debug modes
    return LoopPlan(
        mode=mode,
        start=draw(st.integers(0, num_rollout - 1)),
        num_rollout=num_rollout,
        update_weights_interval=draw(st.integers(1, 3)),
        save=draw(st.booleans()),
        save_hf=draw(st.booleans()),
        save_interval=draw(st.one_of(st.none(), st.integers(1, 3))),
        eval_interval=draw(st.one_of(st.none(), st.integers(1, 3))),
        skip_eval_before_train=draw(st.booleans()),
        sync_weights=not debug,
        offload_rollout=colocated or (mode == "sync" and not debug and draw(st.booleans())),  # sync schedule only
    )


durations = st.fixed_dictionaries(
    {k: st.sampled_from([0.0, 0.5, 1.0, 3.0]) for k in ("eval", "rollout", "train_data", "consume", "train",
                                                         "save", "save_hf", "sync", "release", "resume_weights")}
)  # fmt: skip


def run(plan: LoopPlan, dur: dict[str, float]) -> tuple[TimedBackend, list[tuple[str, int]]]:
    # colocated runs release the engines before the trainer is built (slime/ray/run_start.py): the loop starts there
    backend = TimedBackend(dur, engines="released" if plan.offload_rollout else "serving")
    events: list[tuple[str, int]] = []
    run_virtual(run_loop(plan, backend, lambda kind, ident: events.append((kind, ident))))
    return backend, events


@settings(max_examples=examples(300))
@given(plans(), durations)
def test_each_schedule_issues_its_documented_order(plan, dur):
    backend, events = run(plan, dur)
    assert events == expected_events(plan)
    ran = [c.kind for c in backend.calls]
    if plan.mode == "one_step":  # a launched rollout starts running at the loop's next wait
        ran, events = sorted(ran), sorted(events)
    assert ran == [k for k, _ in events]  # what is recorded is what ran


@settings(max_examples=examples(300))
@given(plans(), durations)
def test_what_overlaps_and_what_never_does(plan, dur):
    backend, _ = run(plan, dur)
    calls = backend.calls
    rollouts = [c for c in calls if c.kind == "rollout"]
    for c in calls:
        if c.kind == "sync":  # weights never change under a rollout, in any schedule
            assert all(r.end <= c.start or r.start >= c.end for r in rollouts), (c, rollouts)
    if plan.mode != "one_step":  # nothing else overlaps: one event at a time
        ordered = sorted(calls, key=lambda c: c.start)
        assert all(a.end <= b.start for a, b in zip(ordered, ordered[1:], strict=False)), ordered
        return
    for t in (c for c in calls if c.kind == "train" and c.ident + 1 < plan.num_rollout):
        (ahead,) = [r for r in rollouts if r.ident == t.ident + 1]
        assert ahead.start <= t.start  # rollout r+1 was launched before step r trains ...
        if dur["rollout"] and dur["train"]:
            assert ahead.end > t.start  # ... and generates while it trains


@settings(max_examples=examples(300))
@given(plans(), durations)
def test_the_trainer_keeps_its_weights_exactly_when_a_sync_follows(plan, dur):
    backend, events = run(plan, dur)
    for c in (c for c in backend.calls if c.kind == "train"):
        assert c.keep_weights == (("sync", c.ident + 1) in events), (c, events)


@settings(max_examples=examples(200))
@given(plans(colocated=True), durations)
def test_colocated_trainer_and_sync_find_the_engines_as_they_must(plan, dur):
    backend, _ = run(plan, dur)
    for c in backend.calls:
        if c.kind == "train":
            assert c.engines == "released"  # the trainer only works while the engines gave their memory up
        if c.kind == "sync":
            assert c.engines == "weights"  # weights land in the engines' weight memory, their KV cache still away
    assert backend.engines == "serving"  # every step gives the engines all their memory back


@settings(max_examples=examples(200))
@given(plans(), durations)
def test_a_step_is_timed_by_its_phases(plan, dur):
    backend, _ = run(plan, dur)
    assert sorted(backend.steps) == list(range(plan.start, plan.num_rollout))
    for times in backend.steps.values():
        phases = sum(times.get(k, 0.0) for k in STEP_PHASES)
        assert times["time/unaccounted"] == pytest.approx(times["time/step"] - phases)
        assert times["time/unaccounted"] >= -1e-9  # the phases never overlap
        assert times["time/train_total"] == pytest.approx(dur["train"])
    if plan.mode == "sync" and plan.num_rollout - plan.start >= 2 and dur["rollout"]:
        assert backend.steps[plan.start + 1]["time/rollout"] == pytest.approx(dur["rollout"] + dur["train_data"])


def test_a_backend_without_an_event_the_plan_needs_is_refused_before_anything_runs():
    class NoCheckpoints(TimedBackend):
        save = LoopBackend.save  # as if it never defined it

    backend = NoCheckpoints({})
    with pytest.raises(TypeError, match="NoCheckpoints cannot run this plan: it has no save event"):
        run_virtual(run_loop(LoopPlan("sync", 0, 2, save=True), backend))
    assert backend.calls == []
    run_virtual(run_loop(LoopPlan("sync", 0, 2), backend))  # without a save plan it runs
    assert [c.kind for c in backend.calls].count("train") == 2


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("interval,steps,save_interval", [(1, 3, None), (2, 5, 2), (3, 4, 1)])
def test_the_simulator_runs_each_schedule_in_its_documented_order(mode, interval, steps, save_interval):
    from sim.scheduling.run import SimConfig, simulate
    from sim.workloads.long_tail import Workload

    tiny = Workload(engines=2, slots_per_engine=4, rollout_batch_size=2, n_samples_per_prompt=2, response_median=20,
                    max_new_tokens=64, weight_sync_s=0.5, train_step_s=1.0)  # fmt: skip
    config = SimConfig(mode, update_weights_interval=interval, max_steps=steps, save_interval=save_interval)
    sim = simulate(config, tiny)
    plan = LoopPlan(mode, 0, steps, interval, save=save_interval is not None, save_interval=save_interval)
    assert [(kind, ident) for _, kind, ident in sim.events] == expected_events(plan)
    assert sim.steps == steps
    assert sorted(sim.checkpoints) == [ident for kind, ident in expected_events(plan) if kind == "save"]


def test_the_simulator_one_step_ahead_generates_while_it_trains():
    """What the order buys, measured on the simulator's clock: one step ahead, the engines work while the
    trainer trains, so over the same steps they are busier and the run is shorter than the sync one."""
    from sim.scheduling.run import SimConfig, simulate
    from sim.workloads.long_tail import Workload

    w = Workload(engines=2, slots_per_engine=8, rollout_batch_size=4, n_samples_per_prompt=2, response_median=40,
                 max_new_tokens=128, weight_sync_s=0.5, train_step_s=20.0)  # fmt: skip
    sync, ahead = (simulate(SimConfig(m, max_steps=6), w) for m in ("sync", "one_step"))
    assert ahead.sim_time_s < sync.sim_time_s
    assert ahead.report()["engine_busy"] > sync.report()["engine_busy"]
