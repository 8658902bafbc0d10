"""Trainer and actor faults through the real `slime train` CLI: a train rank SIGKILLed mid-step is restarted from its
checkpoint and every prompt trains exactly once; without `--max-restarts` the run ends with one line; a few
other faults of bench/faults.py's table (a hung rank, a dead RolloutManager, a crash mid-save) survive too.

The toy job is `sim/fault_job.py`'s (4 rollouts of 10 prompts, steps of 4 groups so 2 are carried over, a
checkpoint after each rollout); prompts are counted from the dumps the final lineage left, as the resume tests do.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sim.fault_job import BATCH, NUM_ROLLOUT, fault_env, job_flags, lineage, prepare_assets, restarts
from sim.slime_run import run_slime_train

pytestmark = [pytest.mark.cpu, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    return prepare_assets(tmp_path_factory.mktemp("faults") / "assets")


def _run(assets: Path, tmp: Path, spec: str, max_restarts: int) -> tuple[int, Path]:
    run = tmp / "run"
    rc = run_slime_train(
        job_flags(assets, run, max_restarts=max_restarts), tmp / "driver.log", 600, fault_env(spec, tmp / "fired")
    )
    assert (tmp / "fired").exists(), "the fault never fired"
    return rc, run


def _trained_exactly_once(run: Path) -> None:
    count = lineage(run)
    assert count["lost"] == 0 and count["repeated"] == 0 and count["unexpected"] == 0, count
    assert count["rollouts_trained"] == list(range(NUM_ROLLOUT))
    assert count["samples_trained"] == NUM_ROLLOUT * BATCH  # carried-over groups trained once, in a later step


def test_train_rank_sigkilled_mid_step_restarts_from_its_checkpoint(assets, tmp_path):
    rc, run = _run(assets, tmp_path, "train:sigkill:train_step:2", max_restarts=1)
    assert rc == 0, (tmp_path / "driver.log").read_text()[-4000:]
    record = restarts(run)
    assert record["restarts"] == 1
    fault = record["attempts"][0]["fault"]
    assert (fault["actor"], fault["fault"], fault["event"], fault["checkpoint_rollout"]) == (
        "train_rank0",
        "died",
        "train 1",
        0,
    )
    summary = json.loads((run / "metrics" / "summary.json").read_text())
    assert summary["resumed_from"] == 0 and sorted(summary["hashes"]) == ["1", "2", "3"]
    _trained_exactly_once(run)


def test_without_restarts_the_run_ends_with_one_line(assets, tmp_path):
    run = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "slime.cli", "train", *job_flags(assets, run)],
        cwd=ROOT,
        env=fault_env("train:exit:save:2", tmp_path / "fired"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 3, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("slime: error:")]
    assert errors == [
        f"slime: error: train_rank0 died during save 1 ({json.loads((run / 'metrics' / 'fault.json').read_text())['detail']}); "
        f"resume from rollout 0's checkpoint with --load {run / 'ckpt'}"
    ]
    assert (run / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "0"


@pytest.mark.parametrize(
    "spec, actor, fault",
    [
        ("train:deadlock:train_step:2", "train_rank0", "hung"),
        ("rollout_manager:sigkill:rollout:2", "rollout_manager", "died"),
        ("train:segfault:weight_sync:3", "train_rank0", "died"),
    ],
)
def test_other_faults_survive_with_restarts(assets, tmp_path, spec, actor, fault):
    rc, run = _run(assets, tmp_path, spec, max_restarts=2)
    assert rc == 0, (tmp_path / "driver.log").read_text()[-4000:]
    record = restarts(run)
    assert [(a["fault"]["actor"], a["fault"]["fault"]) for a in record["attempts"] if a["fault"]] == [(actor, fault)]
    _trained_exactly_once(run)
