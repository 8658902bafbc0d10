"""The `slime train` driver never imports torch: it only places actors, moves references and writes metrics, and
torch would cost every run ~2.5 CPU-seconds at start-up (while the actors compete for the same cores) and ~1 s of
teardown at exit."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.cpu

_PROBE = r"""
import json, sys, tempfile, types
import slime.cli, slime.train, slime.ray.run
from slime.utils import checkpoint_dirs
from slime.ray.rollout_manager import RolloutManager
from slime.ray.train_group import TrainGroup
from slime.ray.loop_backend import RayLoopBackend
from slime.scheduling.loop import run_loop
from slime.utils.tracking import Tracker
d = tempfile.mkdtemp()
t = Tracker(types.SimpleNamespace(metrics_dir=d, use_tensorboard=True, use_wandb=False))
t.log({"reward": 0.5, "loss": 1.0}, step=0)
t.close()
assert checkpoint_dirs.find_checkpoint(d) is None
print(json.dumps({"torch": "torch" in sys.modules, "tb_dir": d + "/tb"}))
"""


def test_the_driver_side_imports_no_torch_and_still_writes_tensorboard() -> None:
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["torch"] is False
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(res["tb_dir"])
    acc.Reload()
    scalars = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    assert scalars == {"train/reward": [(0, 0.5)], "train/loss": [(0, 1.0)]}
