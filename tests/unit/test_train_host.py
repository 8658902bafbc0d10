"""The training seam from the Ray side: `--train-backend` resolves a name or an import path, and the generic host
actor (`TrainRayActor`, run here in-process with the object store stubbed) drives any `TrainBackend` — it takes
the rank's share of the train data by the backend's DP rank, hashes exactly what it passed on, resumes after the
loaded rollout, and forwards every other call as it is."""

from __future__ import annotations

from typing import Any

import pytest
import ray

from slime.arguments import default_args, parse_args
from slime.backends.train_backend import IdleBackend, RankPlace, train_backend_class
from slime.ray.train_actor import TrainRayActor, hash_train_data
from slime.utils.errors import SlimeArgError

pytestmark = pytest.mark.cpu


class RecordingBackend:
    """A third-party backend: two data-parallel ranks' worth of data, this one rank 1."""

    def __init__(self, args: Any, role: str) -> None:
        self.role = role
        self.calls: list[tuple] = []

    def build(self, place: RankPlace, load_path: str | None) -> int | None:
        self.calls.append(("build", place.rank, place.world_size, place.master, load_path))
        return 6 if load_path else None

    def dp_rank(self) -> int:
        return 1

    def train(self, rollout_id: int, data: dict, values: Any, keep_weights: bool) -> tuple[dict, Any]:
        self.calls.append(("train", rollout_id, data, values, keep_weights))
        return {"train/loss": 0.5}, [[0.1]] if self.role == "critic" else None

    def save(self, path: str, rollout_id: int) -> None:
        self.calls.append(("save", path, rollout_id))


def test_train_backend_names_an_import_path_or_a_registered_backend(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    base = [
        "--hf-checkpoint",
        str(tmp_path),
        "--rollout-num-gpus",
        "1",
        "--rollout-batch-size",
        "2",
        "--num-rollout",
        "1",
    ]
    args = parse_args([*base, "--train-backend", f"{__name__}.RecordingBackend"])
    assert train_backend_class(args) is RecordingBackend
    assert train_backend_class(parse_args([*base, "--debug-rollout-only"])) is IdleBackend
    with pytest.raises(SlimeArgError, match="expected megatron or an import path"):
        parse_args([*base, "--train-backend", "fsdp"])


def test_the_host_drives_any_backend(tmp_path, monkeypatch):
    monkeypatch.setattr(ray, "get", lambda ref: ref)  # the refs are the data itself here
    args = default_args(train_backend=f"{__name__}.RecordingBackend", metrics_dir=str(tmp_path), log_level="WARNING")
    host = TrainRayActor(args, rank=1, world_size=2, role="critic")
    assert host.init("10.0.0.1", 1234, "/ckpt/iter_0000006") == 7  # resumes after the loaded rollout
    assert host.backend.calls[0] == ("build", 1, 2, ("10.0.0.1", 1234), "/ckpt/iter_0000006")
    shares = [{"tokens": [[1, 2]]}, {"tokens": [[3, 4, 5]]}]
    (digest, metrics), values = host.train(3, shares, None, True)
    assert digest == hash_train_data(shares[1]) and metrics == {"train/loss": 0.5} and values == [[0.1]]
    assert host.backend.calls[1] == ("train", 3, shares[1], None, True)  # the backend's DP rank's share
    host.call("save", "/ckpt/iter_0000003.tmp", 3)
    assert host.backend.calls[2] == ("save", "/ckpt/iter_0000003.tmp", 3)
    assert host.status()["rank"] == 1 and not host.status()["dist_initialized"]
    fresh = TrainRayActor(args, rank=0, world_size=2)
    assert fresh.init("10.0.0.1", 1234) == 0 and fresh.backend.role == "actor"
