"""Tracker: JSONL records, TensorBoard scalars readable back, progress helper on TTY and non-TTY streams."""

from __future__ import annotations

import argparse
import io
import json
import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch

from slime.utils.tracking import Tracker, progress

pytestmark = pytest.mark.cpu


@pytest.fixture
def tracker_args(tmp_path, make_args: Callable[..., Any]) -> Callable[..., argparse.Namespace]:
    """Args writing under tmp_path/metrics (TensorBoard on: the parser's default)."""
    return lambda **kw: make_args(metrics_dir=str(tmp_path / "metrics"), **kw)


def test_jsonl_records(tmp_path, tracker_args):
    with Tracker(tracker_args(use_tensorboard=False)) as tracker:
        tracker.log({"raw_reward": 0.5, "n": 3, "hist": [1, 2]}, step=0, kind="rollout")
        tracker.log({"loss": torch.tensor(1.25), "nan": float("nan")}, step=1, kind="train")
        tracker.log({"eval/acc": 0.9}, step=1, kind="eval")
    lines = (tmp_path / "metrics" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [(r["step"], r["kind"]) for r in records] == [(0, "rollout"), (1, "train"), (1, "eval")]
    assert records[0]["metrics"] == {"raw_reward": 0.5, "n": 3, "hist": [1, 2]}
    assert records[1]["metrics"] == {"loss": 1.25, "nan": None}  # strict JSON: NaN becomes null
    assert all(isinstance(r["wall_time"], float) for r in records)
    assert records[0]["wall_time"] <= records[2]["wall_time"]
    assert not (tmp_path / "metrics" / "tb").exists()


def test_jsonl_appends_on_resume_and_rejects_unknown_kind(tmp_path, tracker_args):
    args = tracker_args(use_tensorboard=False)
    with Tracker(args) as t:
        t.log({"a": 1}, step=0, kind="train")
        with pytest.raises(ValueError, match="kind"):
            t.log({"a": 1}, step=0, kind="bogus")
    with Tracker(args) as t:
        t.log({"a": 2}, step=1, kind="train")
    records = [json.loads(x) for x in (tmp_path / "metrics" / "metrics.jsonl").read_text().splitlines()]
    assert [r["metrics"]["a"] for r in records] == [1, 2]


def test_tensorboard_scalars_readable(tmp_path, tracker_args):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tracker = Tracker(tracker_args())
    try:
        for step in range(3):
            tracker.log({"raw_reward": 0.25 * step, "hist": [1, 2], "name": "x"}, step=step, kind="rollout")
            tracker.log({"train/loss": 2.0 - step, "grad_norm": torch.tensor(0.5)}, step=step, kind="train")
    finally:
        tracker.close()
    acc = EventAccumulator(str(tmp_path / "metrics" / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert tags == {"rollout/raw_reward", "train/loss", "train/grad_norm"}  # non-scalars only go to JSONL
    reward = [(e.step, e.value) for e in acc.Scalars("rollout/raw_reward")]
    assert reward == [(0, 0.0), (1, 0.25), (2, 0.5)]
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(0, 2.0), (1, 1.0), (2, 0.0)]
    assert [e.value for e in acc.Scalars("train/grad_norm")] == [0.5, 0.5, 0.5]


def test_no_metrics_dir_writes_nothing(tmp_path, monkeypatch, make_args: Callable[..., Any]):
    monkeypatch.chdir(tmp_path)
    with Tracker(make_args(metrics_dir=None)) as t:
        t.log({"a": 1.0}, step=0, kind="train")
    assert list(tmp_path.iterdir()) == []


class _TTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_non_tty_logs_one_line_per_step(caplog):
    stream = io.StringIO()
    with caplog.at_level(logging.INFO, logger="slime.utils.tracking"), progress(4, "rollout", stream=stream) as p:
        assert not p.interactive
        for _ in range(4):
            p.update(reward=0.123456)
    lines = [r.getMessage() for r in caplog.records if r.name == "slime.utils.tracking"]
    assert len(lines) == 4
    assert lines[0].startswith("rollout: 1/4 (25%)") and "reward=0.1235" in lines[0]
    assert lines[-1].startswith("rollout: 4/4 (100%)") and "eta 0:00" in lines[-1]
    assert stream.getvalue() == ""  # quiet: no bar written


def test_progress_tty_draws_bar_and_resumes(caplog):
    stream = _TTY()
    with (
        caplog.at_level(logging.INFO, logger="slime.utils.tracking"),
        progress(10, "train", stream=stream, start=5) as p,
    ):
        assert p.interactive
        p.update(2, loss=0.5)
    assert p.n == 7
    out = stream.getvalue()
    assert "train" in out and "7/10" in out and "loss=0.5" in out
    assert not [r for r in caplog.records if r.name == "slime.utils.tracking"]


def test_two_trackers_share_one_directory(tmp_path, tracker_args):
    # The driver and the RolloutManager actor log into the same metrics_dir.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    a, b = Tracker(tracker_args()), Tracker(tracker_args())
    try:
        for step in range(5):
            a.log({"loss": float(step), "blob": "x" * 5000}, step=step, kind="train")
            b.log({"raw_reward": step / 10}, step=step, kind="rollout")
    finally:
        a.close()
        b.close()
    records = [json.loads(x) for x in (tmp_path / "metrics" / "metrics.jsonl").read_text().splitlines()]
    assert sorted((r["kind"], r["step"]) for r in records) == sorted(
        [("train", s) for s in range(5)] + [("rollout", s) for s in range(5)]
    )
    acc = EventAccumulator(str(tmp_path / "metrics" / "tb"))
    acc.Reload()
    assert {"train/loss", "rollout/raw_reward"} <= set(acc.Tags()["scalars"])
    assert [e.value for e in acc.Scalars("rollout/raw_reward")] == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4])
