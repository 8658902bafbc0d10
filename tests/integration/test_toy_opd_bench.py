"""`bench/toy_opd.py --smoke`: the on-policy distillation bench is wired end to end.

The real bench (SFT student and teacher, GRPO with and without OPD, the teacher served by `--sglang-config`) at a
few steps of everything: the JSON has every arm's curve, and the teacher's log-probs reached the trainer of the
OPD arm only (`train/opd_reverse_kl` is computed from the train data's `teacher_log_probs`).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.cpu, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def test_toy_opd_smoke(tmp_path: Path) -> None:
    out = tmp_path / "toy_opd"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.toy_opd", "--smoke", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((out / "toy_opd.json").read_text())
    steps = res["recipe"]["rl_max_steps"]
    assert set(res["arms"]) == {"control", "opd_sglang", "teacher"}
    for name in ("control", "opd_sglang"):
        # evals at every step (--eval-interval 1 in smoke) and the final one
        assert [s for s, _ in res["arms"][name]["curve"]] == list(range(steps + 1))
        assert "--sglang-config" in res["arms"][name]["command"]
    # same student checkpoint, fixed eval seeds: both arms start from the same held-out number
    assert res["arms"]["control"]["curve"][0] == res["arms"]["opd_sglang"]["curve"][0]
    assert [s for s, _ in res["arms"]["teacher"]["curve"]] == [0]  # the teacher is only evaluated
    kl = res["arms"]["opd_sglang"]["opd_reverse_kl"]
    assert [s for s, _ in kl] == list(range(steps)) and all(v != 0.0 for _, v in kl)
    assert res["arms"]["control"]["opd_reverse_kl"] == []  # no teacher log-probs without --use-opd
    assert set(res["summary"]) == {"control", "opd_sglang"}
    assert "final_minus_control" in res["summary"]["opd_sglang"]
    assert (out / "toy_opd.png").stat().st_size > 0
    assert "held-out" in proc.stdout and "opd_sglang" in proc.stdout  # the table
