"""The synchronous loop of `slime/train.py` and the loop driver's `sync` mode issue the same events in the same
order, and so does the scheduling simulator's sync mode (which runs the driver against simulated engines).

`slime.train.train` runs for real here, with recording stand-ins for what it reaches through Ray (the
RolloutManager handle, the train group, `ray.get`) and for the checkpoint files, so its order of eval, rollout,
train, save and weight sync is observed, not restated.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import ray
from hypothesis import given, settings
from hypothesis import strategies as st

import slime.utils.checkpoint_dirs as checkpoint
import slime.ray.placement as placement
import slime.ray.train_actor as train_actor
import slime.train as train_mod
from slime.arguments import default_args
from slime.scheduling.driver import LoopPlan, run_loop

pytestmark = pytest.mark.cpu


class _Remote:
    def __init__(self, fn: Any) -> None:
        self.remote = fn


class _Handle:
    """`manager.method.remote(...)` calls the stand-in's method at once; `ray.get` is then the identity."""

    def __init__(self, target: Any) -> None:
        self._target = target

    def __getattr__(self, name: str) -> _Remote:
        return _Remote(getattr(self._target, name))


class _Manager:
    def __init__(self, events: list) -> None:
        self.events = events

    def server_info(self) -> dict:
        return {}

    def set_train_parallel_config(self, config: dict) -> None:
        pass

    def load(self, rollout_id: int, path: str) -> None:
        pass

    def lock_weight_sync_engines(self) -> list:
        return []

    def unlock_weight_sync_engines(self) -> None:
        pass

    def eval(self, rollout_id: int) -> dict:
        self.events.append(("eval", rollout_id))
        return {}

    def generate(self, rollout_id: int) -> tuple:
        # the synchronous loop's one call is the driver's rollout + train_data
        self.events += [("rollout", rollout_id), ("train_data", rollout_id)]
        return [f"ref{rollout_id}"], {}

    def save(self, rollout_id: int, path: str) -> None:
        pass

    def dispose(self) -> None:
        pass


class _ManagerClass:
    """`ray.remote(RolloutManager).options(...).remote(args, placement)` -> a handle on a recording manager."""

    def __init__(self, events: list) -> None:
        self.events = events

    def options(self, **kwargs: Any) -> _ManagerClass:
        return self

    def remote(self, *args: Any) -> _Handle:
        return _Handle(_Manager(self.events))


KEPT_WEIGHTS: list[dict[int, bool]] = []  # per driver run: rollout id -> the train call's keep_weights


class _Actors:
    def __init__(self, events: list, args: Any) -> None:
        self.events = events
        self.args = args
        self.kept_weights: dict[int, bool] = {}
        KEPT_WEIGHTS.append(self.kept_weights)

    def init(self, load_path: str | None) -> int:
        return self.args.start_rollout_id or 0  # as TrainRayActor.init without a checkpoint

    def parallel_config(self) -> dict:
        return {"dp_size": 1, "cp_size": 1}

    def status(self) -> list:
        return []

    def train(self, rollout_id: int, refs: list, keep_weights: bool = False) -> tuple:
        self.events.append(("train", rollout_id))
        self.kept_weights[rollout_id] = keep_weights  # the driver's promise that a weight sync follows
        return [None], {}

    def update_weights(self, engines: list, version: int) -> dict:
        self.events.append(("sync", version))
        return {}

    def save(self, path: str, rollout_id: int) -> None:
        pass

    def save_hf(self, path: str) -> None:
        self.events.append(("save_hf", int(path.rsplit("/", 1)[1])))

    def offload_events(self) -> list:
        return []


def real_sync_loop(args: Any, resume_from: int | None, tmp_dir: str) -> list[tuple[str, int]]:
    """Events of `slime.train.train` with Ray and the checkpoint files replaced by recorders."""
    events: list[tuple[str, int]] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(train_mod, "preflight", lambda a: 1000)
        mp.setattr(placement, "init_ray", lambda a: None)
        mp.setattr(placement, "create_placement_group", lambda a: None)
        mp.setattr(ray, "get", lambda x, timeout=None: x)
        mp.setattr(ray, "shutdown", lambda: None)
        mp.setattr(ray, "remote", lambda cls: _ManagerClass(events))
        mp.setattr(train_actor, "RayTrainGroup", lambda a, p, role="actor": _Actors(events, a))
        mp.setattr(
            checkpoint, "find_checkpoint", lambda root: (resume_from, "ckpt") if resume_from is not None else None
        )

        def begin_save(root: str, rollout_id: int) -> str:
            events.append(("save", rollout_id))
            return tmp_dir

        mp.setattr(checkpoint, "begin_save", begin_save)
        mp.setattr(checkpoint, "finish_save", lambda root, rollout_id, meta: tmp_dir)
        train_mod.train(args)
    # one "save" event per saving step, whether it writes a checkpoint, an HF export or both
    out: list[tuple[str, int]] = []
    for e in events:
        kind = "save" if e[0] == "save_hf" else e[0]
        if not (kind == "save" and out and out[-1] == ("save", e[1])):
            out.append((kind, e[1]))
    return out


class _RecordingBackend:
    async def evaluate(self, rollout_id: int) -> None: ...
    async def rollout(self, rollout_id: int) -> None: ...
    async def train_data(self, rollout_id: int) -> Any: ...
    async def start_producer(self, rollout_id: int) -> None: ...
    async def consume(self, rollout_id: int) -> Any: ...
    async def stop_producer(self) -> None: ...
    async def train(self, rollout_id: int, batch: Any) -> None: ...
    async def save(self, rollout_id: int) -> None: ...
    async def sync_weights(self, version: int) -> None: ...
    async def step_done(self, rollout_id: int) -> None: ...


def driver_events(plan: LoopPlan) -> list[tuple[str, int]]:
    events: list[tuple[str, int]] = []
    asyncio.run(run_loop(plan, _RecordingBackend(), lambda kind, ident: events.append((kind, ident))))
    return events


@st.composite
def plans(draw):
    num_rollout = draw(st.integers(1, 7))
    start = draw(st.integers(0, num_rollout - 1))
    save = draw(st.sampled_from([None, "ckpt", "hf", "both"]))
    return dict(
        num_rollout=num_rollout,
        start=start,
        resume=draw(st.booleans()) and start > 0,
        update_weights_interval=draw(st.integers(1, 3)),
        save_interval=draw(st.one_of(st.none(), st.integers(1, 3))),
        save=save,
        eval_interval=draw(st.one_of(st.none(), st.integers(1, 3))),
        skip_eval_before_train=draw(st.booleans()),
    )


@settings(deadline=None)
@given(plans())
def test_train_py_sync_loop_matches_the_driver(tmp_path_factory, p):
    tmp = tmp_path_factory.mktemp("loop")
    args = default_args(
        num_rollout=p["num_rollout"],
        start_rollout_id=None if p["resume"] else p["start"],
        rollout_batch_size=1,
        update_weights_interval=p["update_weights_interval"],
        save=str(tmp / "ckpt") if p["save"] in ("ckpt", "both") else None,
        save_hf=str(tmp / "hf" / "{rollout_id}") if p["save"] in ("hf", "both") else None,
        save_interval=p["save_interval"],
        eval_interval=p["eval_interval"],
        skip_eval_before_train=p["skip_eval_before_train"],
        metrics_dir=str(tmp / "metrics"),
        use_tensorboard=False,
    )
    real = real_sync_loop(args, p["start"] - 1 if p["resume"] else None, str(tmp))
    assert real[0] == ("sync", p["start"])
    assert [e for e in real if e[0] == "train"] == [("train", r) for r in range(p["start"], p["num_rollout"])]
    assert real == driver_events(LoopPlan.from_args(args, p["start"]))
    # a train call keeps the weights on the GPU exactly when its rollout's weight sync follows
    kept = KEPT_WEIGHTS[-1]
    for event in real:
        if event[0] == "train":
            assert kept[event[1]] == (("sync", event[1] + 1) in real), (event, real)


@pytest.mark.parametrize("interval,steps", [(1, 3), (2, 5), (3, 4)])
def test_simulator_sync_mode_reproduces_the_real_loop(tmp_path, interval, steps):
    from sim.scheduling.run import SimConfig, simulate
    from sim.workloads.long_tail import Workload

    tiny = Workload(engines=2, slots_per_engine=4, rollout_batch_size=2, n_samples_per_prompt=2, response_median=20,
                    max_new_tokens=64, weight_sync_s=0.5, train_step_s=1.0)  # fmt: skip
    sim = simulate(SimConfig("sync", update_weights_interval=interval, max_steps=steps), tiny)
    args = default_args(
        num_rollout=steps, rollout_batch_size=1, update_weights_interval=interval,
        metrics_dir=str(tmp_path / "metrics"), use_tensorboard=False,
    )  # fmt: skip
    assert [(kind, ident) for _, kind, ident in sim.events] == real_sync_loop(args, None, str(tmp_path))
