"""The checkpoint directory protocol and the RolloutManager's part of a checkpoint (no megatron, no Ray).

A save is visible only once complete: `begin_save` writes into `iter_XXXXXXX.tmp`, `finish_save` marks it,
renames it and only then moves the tracker. A process killed anywhere before that leaves the tracker on the
previous checkpoint, and the next save removes the debris. The RolloutManager saves the data source (position,
counters, partial-rollout buffer) and the carried-over groups next to the trainer's shards.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slime.utils import checkpoint_dirs as ck

pytestmark = pytest.mark.cpu


def _save(root: Path, rollout_id: int, *, complete: bool = True) -> Path:
    tmp = Path(ck.begin_save(str(root), rollout_id))
    (tmp / "common.pt").write_text(f"rollout {rollout_id}")  # stands in for the trainer's shards
    if complete:
        return Path(ck.finish_save(str(root), rollout_id, {"rollout_id": rollout_id}))
    return tmp


def test_no_tracker_means_start_fresh(tmp_path):
    assert ck.find_checkpoint(None) is None
    assert ck.find_checkpoint(str(tmp_path)) is None
    assert ck.read_tracker(str(tmp_path / "missing")) is None


def test_save_is_renamed_then_tracked(tmp_path):
    final = _save(tmp_path, 3)
    assert final == tmp_path / "iter_0000003" and (final / ck.MARKER).is_file()
    assert (tmp_path / ck.TRACKER).read_text() == "3"
    assert ck.find_checkpoint(str(tmp_path)) == (3, str(final))
    assert json.loads((final / ck.MARKER).read_text())["rollout_id"] == 3
    assert not list(tmp_path.glob("*.tmp*"))


def test_killed_save_leaves_previous_checkpoint_and_is_cleaned(tmp_path):
    _save(tmp_path, 0)
    torn = _save(tmp_path, 1, complete=False)  # "killed" while writing rollout 1's shards
    assert ck.find_checkpoint(str(tmp_path)) == (0, str(tmp_path / "iter_0000000"))
    assert torn.exists() and not (tmp_path / "iter_0000001").exists()
    _save(tmp_path, 1)  # the resumed run saves rollout 1 again
    assert ck.find_checkpoint(str(tmp_path))[0] == 1
    assert (tmp_path / "iter_0000001" / "common.pt").read_text() == "rollout 1"
    assert not list(tmp_path.glob("*.tmp"))


def test_killed_between_rename_and_tracker(tmp_path):
    """The rename happened, the tracker did not move: resume from the older one, re-save replaces the newer."""
    _save(tmp_path, 0)
    _save(tmp_path, 1)
    (tmp_path / ck.TRACKER).write_text("0")
    assert ck.find_checkpoint(str(tmp_path))[0] == 0
    tmp = Path(ck.begin_save(str(tmp_path), 1))
    (tmp / "common.pt").write_text("rollout 1, second time")
    ck.finish_save(str(tmp_path), 1, {})
    assert (tmp_path / "iter_0000001" / "common.pt").read_text() == "rollout 1, second time"
    assert not (tmp_path / "iter_0000001.old").exists()


def test_tracker_pointing_at_incomplete_dir_is_an_error(tmp_path):
    _save(tmp_path, 0)
    (tmp_path / ck.TRACKER).write_text("5")
    with pytest.raises(RuntimeError, match="not a complete checkpoint"):
        ck.find_checkpoint(str(tmp_path))
    (tmp_path / ck.TRACKER).write_text("five")
    with pytest.raises(RuntimeError, match="corrupt"):
        ck.read_tracker(str(tmp_path))


@pytest.fixture
def manager_args(tmp_path):
    from sim.tiny_checkpoint import build_tiny_checkpoint
    from slime.arguments import parse_args

    model = build_tiny_checkpoint(tmp_path / "model")
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"input": f"q{i}", "label": str(i)}) + "\n" for i in range(7)))
    return parse_args([
        "--hf-checkpoint", str(model), "--prompt-data", str(data), "--rollout-batch-size", "3",
        "--n-samples-per-prompt", "2", "--num-rollout", "4", "--debug-train-only", "--rollout-shuffle",
        "--metrics-dir", str(tmp_path / "metrics"), "--no-use-tensorboard",
    ])  # fmt: skip


def test_manager_saves_data_source_buffer_and_carry(manager_args, tmp_path):
    from slime.ray.rollout_manager import RolloutManager
    from slime.utils.types import Sample

    m = RolloutManager(manager_args, None)
    m.data_source.get_samples(5)
    partial = m.data_source.get_samples(1)
    partial[0][0].response = "half"
    m.data_source.add_samples(partial)  # a partial rollout waits in the buffer
    carried = [Sample(index=100 + i, group_index=50, group_id=100 + i, tokens=[1, 2, 3], response_length=1)
               for i in range(2)]  # fmt: skip
    batch = m.carry.merge(2, carried, {"rewards": [0.5, -0.5], "raw_reward": [1.0, 0.0]})
    m.carry.defer(batch, [0, 1])
    ckpt_dir = tmp_path / "iter_0000002.tmp"
    m.save(2, str(ckpt_dir))
    expected_next = m.data_source.get_samples(3)
    m.dispose()

    fresh = RolloutManager(manager_args, None)
    fresh.load(2, str(ckpt_dir))
    assert sorted(fresh.carry.group_ids) == [100, 101]
    groups = fresh.carry.state_dict()["groups"]
    assert [s["tokens"] for g in groups for s in g["samples"]] == [[1, 2, 3], [1, 2, 3]]
    assert [v for g in groups for v in g["values"]["rewards"]] == [0.5, -0.5]
    got = fresh.data_source.get_samples(3)  # the buffered partial group first, then the same prompts
    assert got[0][0].response == "half"
    assert [[(s.prompt, s.index, s.group_index) for s in g] for g in got] == [
        [(s.prompt, s.index, s.group_index) for s in g] for g in expected_next
    ]
    fresh.dispose()
