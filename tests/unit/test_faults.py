"""The fault injector's spec parsing and off path, the fault records, the restart supervisor's decisions and the
fault flags' refusals (slime/utils/faults.py, slime/ray/actor_faults.py, slime/ray/restarts.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from slime.arguments import default_args
from slime.ray import actor_faults, restarts
from slime.ray.actor_faults import ActorFault, ActorHung
from slime.ray.arguments import validate_fault_args
from slime.utils import checkpoint_dirs, faults
from slime.utils.errors import SlimeArgError

pytestmark = pytest.mark.cpu
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _fresh_injector(monkeypatch):
    monkeypatch.delenv(faults.ENV, raising=False)
    monkeypatch.delenv(faults.MARKER_ENV, raising=False)
    faults.reset()
    yield
    faults.reset()


def test_specs_parse_with_default_and_explicit_nth():
    assert faults.parse_specs("train:sigkill:train_step, rollout_manager:deadlock:save:3") == [
        faults.FaultSpec("train", "sigkill", "train_step", 1),
        faults.FaultSpec("rollout_manager", "deadlock", "save", 3),
    ]
    assert faults.parse_specs("") == []


@pytest.mark.parametrize(
    "text, needle",
    [
        ("train:sigkill", "KIND:FAULT:POINT"),
        ("trainer:sigkill:save", "unknown kind 'trainer'"),
        ("train:sigterm:save", "unknown fault 'sigterm'"),
        ("train:exit:backward", "unknown point 'backward'"),
        ("train:exit:save:0", "NTH must be an integer >= 1"),
        ("train:exit:save:x", "NTH must be an integer >= 1"),
    ],
)
def test_bad_specs_are_refused_with_what_is_wrong(text, needle):
    with pytest.raises(ValueError, match=needle):
        faults.parse_specs(text)


def test_off_path_reads_the_environment_once(monkeypatch):
    faults.inject("train", "train_step")
    assert faults._specs == []  # cached: later calls are one comparison
    monkeypatch.setenv(faults.ENV, "train:sigkill:train_step")
    faults.inject("train", "train_step")  # still off: the variable is read once per process
    assert faults._seen == {}


def test_fires_on_the_nth_matching_point_only(monkeypatch):
    fired = []
    monkeypatch.setattr(faults, "fire", lambda fault, what: fired.append((fault, what)))
    monkeypatch.setenv(faults.ENV, "train:exit:save:2")
    for point in ("save", "train_step", "save", "save"):
        faults.inject("train", point)
    faults.inject("critic", "save")
    assert fired == [("exit", "train:exit:save:2")]


def test_marker_makes_a_fault_fire_once_per_job(monkeypatch, tmp_path):
    fired = []
    monkeypatch.setattr(faults, "fire", lambda fault, what: fired.append(fault))
    monkeypatch.setenv(faults.ENV, "rollout_manager:sigkill:rollout")
    monkeypatch.setenv(faults.MARKER_ENV, str(tmp_path / "fired"))
    faults.inject("rollout_manager", "rollout")
    faults.reset()  # a restarted process: counts start again, the marker stays
    faults.inject("rollout_manager", "rollout")
    assert fired == ["sigkill"]
    assert json.loads((tmp_path / "fired").read_text())["spec"] == "rollout_manager:sigkill:rollout:1"


@pytest.mark.parametrize("fault, rc", [("sigkill", -signal.SIGKILL), ("exit", 1), ("segfault", -signal.SIGSEGV)])
def test_faults_end_the_process_as_named(fault, rc):
    code = "from slime.utils import faults; faults.inject('train', 'save'); print('survived')"
    env = {**os.environ, faults.ENV: f"train:{fault}:save", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-X", "faulthandler", "-c", code], env=env, capture_output=True, timeout=60)
    assert proc.returncode == rc and b"survived" not in proc.stdout


def test_deadlock_hangs_the_process():
    code = "from slime.utils import faults; faults.inject('engine', 'rollout'); print('survived')"
    env = {**os.environ, faults.ENV: "engine:deadlock:rollout", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE)
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=3)
    finally:
        proc.kill()
        proc.wait()
    assert proc.stdout.read() == b""


def test_signal_fault_delivers_the_fault_to_another_process(monkeypatch):
    monkeypatch.setenv(faults.ENV, "router:deadlock:rollout")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert not faults.signal_fault("router", "save", child.pid)
        assert faults.signal_fault("router", "rollout", child.pid)  # deadlock: SIGSTOP, alive but frozen
        assert child.poll() is None
    finally:
        child.kill()
        child.wait()


def test_fault_line_names_actor_fault_and_checkpoint(tmp_path):
    f = ActorFault("train_rank0", "died", "its process 7 exited", "train 3", str(tmp_path / "iter_0000002"), 2)
    assert f.line() == (
        f"train_rank0 died during train 3 (its process 7 exited); resume from rollout 2's checkpoint with --load "
        f"{tmp_path}"
    )
    f.write(str(tmp_path / "m"))
    assert actor_faults.read_fault(str(tmp_path / "m"))["actor"] == "train_rank0"
    fresh = ActorFault("rollout_manager", "hung", "rollout gave no answer in 5 s", "rollout 0")
    assert fresh.line().endswith("no complete checkpoint yet: a rerun starts over")


def test_classify_unwraps_to_the_faulty_actor():
    from ray.exceptions import RayActorError, RayTaskError

    dead = RayActorError(actor_id="ab" * 16, error_msg="The actor died.\n\tclass_name: SGLangEngine\n\tpid: 42")
    assert actor_faults.classify(dead, {"ab" * 16: "train_rank1"}) == ("train_rank1", "died", "its process 42 exited")
    assert actor_faults.classify(dead, {}) == ("SGLangEngine", "died", "its process 42 exited")
    wrapped = RayTaskError("rollout", "tb", ActorHung("rollout_manager", "rollout", 5.0))
    assert actor_faults.classify(wrapped, {}) == ("rollout_manager", "hung", "rollout gave no answer in 5 s")
    server = RayTaskError("rollout", "tb", actor_faults.ServerDied("router", "its process 9 exited"))
    assert actor_faults.classify(server, {}) == ("router", "died", "its process 9 exited")
    assert actor_faults.classify(ValueError("a bug"), {}) is None


@pytest.mark.parametrize(
    "rc, fault, done, expect",
    [
        (0, None, 0, False),
        (3, {"actor": "train_rank0", "fault": "died"}, 0, True),
        (3, {"actor": "rollout_manager", "fault": "hung"}, 1, True),
        (3, {"actor": "train_rank0", "fault": "died"}, 2, False),  # no restart left
        (1, None, 0, False),  # an actor's own exception: a restart would repeat it
        (2, None, 0, False),  # a user error
        (130, None, 0, False),  # interrupted
        (-signal.SIGINT, None, 0, False),
        (-signal.SIGKILL, None, 0, True),  # the driver itself was killed
    ],
)
def test_supervisor_decisions(rc, fault, done, expect):
    decision = restarts.decide(rc, fault, done, max_restarts=2)
    assert decision.restart is expect, decision.reason


def test_restart_resumes_from_the_save_dir_once_it_holds_a_checkpoint(tmp_path):
    save = tmp_path / "ckpt"
    argv = ["--save", str(save), "--load", "/pretrained"]
    assert restarts.attempt_argv(argv, str(save)) == [*argv, "--max-restarts", "0"]
    tmp = checkpoint_dirs.begin_save(str(save), 1)
    Path(tmp, "shard").write_text("x")
    checkpoint_dirs.finish_save(str(save), 1, {"rollout_id": 1})
    out = restarts.attempt_argv(argv, str(save))
    assert out[-4:] == ["--max-restarts", "0", "--load", str(save)]


def test_supervisor_restarts_after_a_fault_then_stops(monkeypatch, tmp_path):
    metrics = tmp_path / "m"
    outcomes = iter([3, 3, 0])
    seen: list[list[str]] = []

    def attempt(argv: list[str]) -> int:
        seen.append(argv)
        rc = next(outcomes)
        if rc == 3:
            ActorFault("train_rank0", "died", "its process 1 exited", "train 1").write(str(metrics))
        return rc

    monkeypatch.setattr(restarts, "_run_attempt", attempt)
    args = default_args(max_restarts=2, metrics_dir=str(metrics), save=str(tmp_path / "ckpt"))
    assert restarts.supervise(["--x"], args) == 0
    record = json.loads((metrics / "restarts.json").read_text())
    assert record["restarts"] == 2 and [a["rc"] for a in record["attempts"]] == [3, 3, 0]
    assert sorted(p.name for p in (metrics / "restarts").iterdir()) == ["attempt_0.json", "attempt_1.json"]
    assert all(a[-2:] == ["--max-restarts", "0"] for a in seen)


@pytest.mark.parametrize(
    "overrides, needle",
    [
        ({"max_restarts": -1}, "--max-restarts must be >= 0"),
        ({"train_hang_timeout": 0.0}, "--train-hang-timeout must be > 0"),
        ({"rollout_hang_timeout": -3.0}, "--rollout-hang-timeout must be > 0"),
        ({"max_restarts": 1}, "--max-restarts needs --save"),
        ({"max_restarts": 1, "save": "/c", "start_rollout_id": 2}, "drop --start-rollout-id"),
    ],
)
def test_fault_flags_refuse_bad_values(overrides, needle):
    with pytest.raises(SlimeArgError, match=needle):
        validate_fault_args(default_args(**overrides))


def test_bad_flag_is_one_line_before_ray_starts(tmp_path):
    script = textwrap.dedent(
        """
        import sys
        from slime.cli import main
        rc = main(["train", "--max-restarts", "2", "--rollout-batch-size", "4", "--num-rollout", "2", "--hf-checkpoint", sys.argv[1]])
        assert "ray" not in sys.modules
        sys.exit(rc)
        """
    )
    (tmp_path / "config.json").write_text("{}")
    proc = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "slime: error: --max-restarts needs --save: a restart resumes from the newest complete checkpoint"
    ]


def test_parsed_flags_reach_args():
    from slime.arguments import build_parser

    args, _ = build_parser().parse_known_args(["--train-hang-timeout", "4", "--rollout-hang-timeout", "9"])
    assert (args.train_hang_timeout, args.rollout_hang_timeout, args.max_restarts) == (4.0, 9.0, 0)
