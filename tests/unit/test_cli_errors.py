"""Bad input to `slime train`: one clear line, exit code 2, no traceback, nothing started.

"Nothing started" is checked on the real process: Ray is pointed at a fresh RAY_TMPDIR (every `ray.init`
creates a session directory there) and the metrics directory must not appear.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.cpu


@pytest.fixture()
def world(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    data = tmp_path / "train.jsonl"
    data.write_text('{"input": "a", "label": "1"}\n{"input": "b", "label": "2"}\n')
    return tmp_path, str(model), str(data)


def run_slime(tmp_path, argv: list[str]) -> subprocess.CompletedProcess:
    ray_tmp = tmp_path / "ray_tmp"
    ray_tmp.mkdir(exist_ok=True)
    env = {**os.environ, "RAY_TMPDIR": str(ray_tmp), "SLIME_LOG_LEVEL": "WARNING"}
    env.pop("SLIME_DEBUG", None)
    return subprocess.run(
        [sys.executable, "-m", "slime.cli", "train", *argv, "--metrics-dir", str(tmp_path / "metrics")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def common(model: str, data: str) -> list[str]:
    return ["--hf-checkpoint", model, "--prompt-data", data, "--num-rollout", "1", "--rollout-num-gpus", "1",
            "--rollout-engine", "sim"]  # fmt: skip


def assert_one_line_and_nothing_started(tmp_path, proc, *needles: str) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("slime: error: ")
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not os.listdir(tmp_path / "ray_tmp"), "ray.init ran"
    assert not (tmp_path / "metrics").exists()


def test_unknown_flag(world):
    tmp, model, data = world
    proc = run_slime(tmp, [*common(model, data), "--rollout-batch-size", "1", "--n-sample-per-prompt", "2"])
    assert_one_line_and_nothing_started(tmp, proc, "unknown flag --n-sample-per-prompt", "--n-samples-per-prompt")


def test_unknown_sglang_flag(world):
    tmp, model, data = world
    proc = run_slime(tmp, [*common(model, data), "--rollout-batch-size", "1", "--sglang-mem-fraction", "0.5"])
    assert_one_line_and_nothing_started(tmp, proc, "--sglang-mem-fraction")


def test_missing_dataset_file(world):
    tmp, model, _ = world
    proc = run_slime(tmp, [*common(model, str(tmp / "nope.jsonl")), "--rollout-batch-size", "1"])
    assert_one_line_and_nothing_started(tmp, proc, "--prompt-data", "nope.jsonl")


def test_malformed_jsonl_line_number(world):
    tmp, model, _ = world
    bad = tmp / "bad.jsonl"
    bad.write_text('{"input": "a"}\n{"input": "b"}\n{"input": "c",\n{"input": "d"}\n')
    proc = run_slime(tmp, [*common(model, str(bad)), "--rollout-batch-size", "1"])
    assert_one_line_and_nothing_started(tmp, proc, "bad.jsonl:3")


def test_missing_rollout_batch_size(world):
    tmp, model, data = world
    proc = run_slime(tmp, common(model, data))
    assert_one_line_and_nothing_started(tmp, proc, "--rollout-batch-size is required")
