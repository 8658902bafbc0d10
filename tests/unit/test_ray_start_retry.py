"""`init_ray` starts a local Ray cluster once more when its node misses Ray's start-up deadline (a loaded laptop),
and only then (slime/ray/placement.py)."""

from __future__ import annotations

import pytest

from slime.arguments import default_args
from slime.ray import placement

pytestmark = pytest.mark.cpu


@pytest.fixture(autouse=True)
def _isolated(monkeypatch):
    """init_ray sets environment variables and a module flag for the run it starts: keep them to this test."""
    import os

    monkeypatch.setattr(os, "environ", os.environ.copy())
    monkeypatch.setattr(placement, "_logical_gpus", placement._logical_gpus)


def _fake_init(failures: list[Exception]):
    calls: list[dict] = []

    def init(**kw):
        calls.append(kw)
        if failures:
            raise failures.pop(0)

    return init, calls


def test_a_startup_timeout_is_retried_once(monkeypatch):
    init, calls = _fake_init([Exception("The current node timed out during startup. This could happen ...")])
    monkeypatch.setattr(placement.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(placement.ray, "init", init)
    monkeypatch.setattr(placement.ray, "shutdown", lambda: None)
    placement.init_ray(default_args(actor_num_gpus_per_node=1, rollout_num_gpus=1))
    assert len(calls) == 2


@pytest.mark.parametrize(
    "failures",
    [[RuntimeError("something else")], [Exception("timed out during startup")] * 2],
    ids=["other error", "twice"],
)
def test_other_errors_and_a_second_timeout_are_raised(monkeypatch, failures):
    init, calls = _fake_init(list(failures))
    monkeypatch.setattr(placement.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(placement.ray, "init", init)
    monkeypatch.setattr(placement.ray, "shutdown", lambda: None)
    with pytest.raises(Exception, match="something else|timed out during startup"):
        placement.init_ray(default_args(actor_num_gpus_per_node=1, rollout_num_gpus=1))
    assert len(calls) == len(failures)
