"""The GPU nightly's summary (ci/gpu_nightly_summary.py) counts what ran and never reports a missing part as passed."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.cpu
ROOT = Path(__file__).resolve().parents[2]

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="1" failures="1"
skipped="2" tests="7"><testcase classname="tests.gpu.test_a" name="test_ok"/><testcase classname="tests.gpu.test_a"
name="test_bad"><failure message="x"/></testcase><testcase classname="tests.gpu.test_b" name="test_err"><error
message="y"/></testcase></testsuite></testsuites>"""

TRAIN = [{"model": "1.8B", "adam": "fused", "micro_batches": 4, "step_s_median": 0.5, "optimizer_s": 0.02,
          "tokens_per_s": 32768.0, "mfu": 0.31, "mfu_fwd_bwd_only": 0.33}]  # fmt: skip


def _module():
    spec = importlib.util.spec_from_file_location("gpu_nightly_summary", ROOT / "ci" / "gpu_nightly_summary.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_counts_failures_and_reports_missing_parts(tmp_path):
    (tmp_path / "tests.xml").write_text(JUNIT)
    (tmp_path / "gpu_train.json").write_text(json.dumps(TRAIN))
    summary = _module().summarize(tmp_path, {"tests": 1, "sync": 0, "train": 0})
    t = summary["parts"]["tests"]
    assert (t["tests"], t["passed"], t["failures"], t["errors"], t["skipped"]) == (7, 3, 1, 1, 2)
    assert t["failed_ids"] == ["tests.gpu.test_a::test_bad", "tests.gpu.test_b::test_err"]
    assert summary["parts"]["sync"]["missing"] == "gpu_weight_sync.json"  # exit 0 but nothing written
    assert summary["parts"]["train"]["result"] == TRAIN
    assert not summary["ok"]
    md = (tmp_path / "nightly.md").read_text()
    assert "## tests: FAILED (exit 1)" in md and "`tests.gpu.test_a::test_bad`" in md
    assert "no gpu_weight_sync.json" in md and "| 1.8B | fused | 4 | 0.500 | 0.020 | 32768 | 31.0% | 33.0% |" in md
    assert json.loads((tmp_path / "nightly.json").read_text())["ok"] is False


def test_all_parts_passing_is_ok(tmp_path):
    (tmp_path / "tests.xml").write_text(JUNIT.replace('errors="1" failures="1"', 'errors="0" failures="0"'))
    assert _module().summarize(tmp_path, {"tests": 0})["ok"]


def test_nightly_script_is_valid_bash():
    script = ROOT / "ci" / "gpu-nightly.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
