"""Tracker: JSONL records, TensorBoard scalars and W&B offline runs readable back, and the progress line."""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch

from slime.utils.tracking import Tracker, progress, step_line

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


def test_progress_logs_one_line_per_step_with_the_steps_summary(caplog):
    with caplog.at_level(logging.INFO, logger="slime.utils.tracking"), progress(4, "rollout") as p:
        for step in range(4):
            metrics = {
                "rollout/raw_reward_mean": 0.25 * step,
                "time/step": 2.0,
                "time/rollout": 1.5,
                "time/train": 0.4,
            }
            p.update(detail=step_line(metrics, {"eval/toy": 0.5, "eval/toy/truncated": 0.1}), loss=0.123456)
    lines = [r.getMessage() for r in caplog.records if r.name == "slime.utils.tracking"]
    assert len(lines) == 4
    assert lines[0].startswith("rollout 1/4 | reward 0.000 | eval/toy 0.500 | 2.0s [rollout 1.5 train 0.4]")
    assert "loss=0.1235" in lines[0] and "eval/toy/truncated" not in lines[0]
    assert lines[-1].startswith("rollout 4/4 | reward 0.750") and lines[-1].endswith("eta 0:00")


def test_progress_resumes_from_start(caplog):
    with caplog.at_level(logging.INFO, logger="slime.utils.tracking"), progress(10, "rollout", start=5) as p:
        p.update(2)
    assert p.n == 7
    assert [r.getMessage() for r in caplog.records][-1].startswith("rollout 7/10 | elapsed")


def read_wandb_history(run_dir) -> tuple[list[dict[str, Any]], dict[str, Any], str, bool]:
    """(history rows, config, group, whether the run's exit record is there) of an offline W&B run, read from its
    .wandb file (LevelDB-style log records: 7-byte header, 32 KiB blocks, records split FIRST/MIDDLE/LAST) with
    W&B's own protobuf types."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = list(run_dir.glob("run-*.wandb"))
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    rows, config, group, exited, pos, buf = [], {}, "", False, 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:
            pos += 32768 - pos % 32768
            continue
        _, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + n], pos + 7 + n
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf + chunk if kind == 4 else chunk)
            buf = b""
            which = rec.WhichOneof("record_type")
            if which == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item})
            elif which == "exit":
                exited = True
            elif which == "run":
                config = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.run.config.update}
                group = rec.run.run_group
        elif kind == 2:
            buf = chunk
        elif kind == 3:
            buf += chunk
        else:
            break
    return rows, config, group, exited


def test_wandb_offline_run_holds_the_metrics_and_the_args(tmp_path, tracker_args):
    args = tracker_args(use_wandb=True, wandb_mode="offline", wandb_group="seeds", lr=3e-4, use_tensorboard=False)
    with Tracker(args) as t:
        for step in range(3):
            t.log({"raw_reward_mean": 0.1 * step}, step=step, kind="rollout")
            t.log({"train/loss": 1.0 / (step + 1), "blob": "not a scalar"}, step=step, kind="train")
    runs = list((tmp_path / "metrics" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    # complete when the tracker has closed (Tracker.close waits for W&B's service): the exit record is there
    rows, config, group, exited = read_wandb_history(runs[0])
    assert exited
    by_step: dict[int, dict[str, Any]] = {}
    for row in rows:
        by_step.setdefault(row["_step"], {}).update(row)
    assert sorted(by_step) == [0, 1, 2], rows
    assert [by_step[s]["rollout/raw_reward_mean"] for s in range(3)] == pytest.approx([0.0, 0.1, 0.2])
    assert [by_step[s]["train/loss"] for s in range(3)] == pytest.approx([1.0, 0.5, 1 / 3])
    assert "train/blob" not in by_step[0]
    assert config["lr"] == 3e-4 and config["wandb_mode"] == "offline" and group == "seeds"


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
