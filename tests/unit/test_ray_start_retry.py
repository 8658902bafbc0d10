"""`init_ray` starts a local Ray cluster once more when its node misses Ray's start-up deadline (a loaded laptop),
and only then; and how the workers get their environment (slime/ray/placement.py)."""

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


def test_a_local_cluster_gets_the_worker_env_by_inheritance(monkeypatch):
    """No job runtime_env (Ray would start every worker through setup_worker.py): the variables are in the
    environment while `ray.init` starts the cluster's processes, and the driver's own environment is as before."""
    import os

    monkeypatch.delenv("NCCL_CUMEM_ENABLE", raising=False)
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    init, calls = _fake_init([])
    seen: list[dict] = []
    monkeypatch.setattr(placement.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(placement.ray, "init", lambda **kw: (seen.append(dict(os.environ)), init(**kw)))
    placement.init_ray(default_args(actor_num_gpus_per_node=1, rollout_num_gpus=1))
    assert len(calls) == 1 and "runtime_env" not in calls[0]
    inside = seen[0]
    assert inside["NCCL_CUMEM_ENABLE"] == "0" and inside["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] == "1"
    assert inside["PYTHONPATH"] == os.pathsep.join([os.getcwd(), "/somewhere"])
    assert inside["PYTHONWARNINGS"]  # the known third-party warnings, filtered where each worker starts
    assert "NCCL_CUMEM_ENABLE" not in os.environ and os.environ["PYTHONPATH"] == "/somewhere"
    assert os.environ["SLIME_NODE_ADDRESS"] == "127.0.0.1"  # the driver binds loopback too


def test_a_joined_cluster_still_gets_a_runtime_env(monkeypatch):
    init, calls = _fake_init([])
    monkeypatch.setattr(placement.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(placement.ray, "init", init)
    placement.init_ray(default_args(actor_num_gpus_per_node=1, rollout_num_gpus=1, ray_address="10.0.0.1:6379"))
    assert calls[0]["runtime_env"]["env_vars"]["NCCL_CUMEM_ENABLE"] == "0"
