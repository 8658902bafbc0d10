"""`slime train --fully-async` and `--one-step-ahead` through the real CLI (Ray, the real router, fake engines,
megatron-core on CPU), each killed after a checkpoint and resumed: no prompt is lost or trained twice.

Fully async runs on a `synthetic` engine slow enough (0.3 s per token) that groups are always in flight: every
checkpoint holds in-flight groups, and the kill lands while requests run. The resumed run must train the prompts
the checkpoint owed (buffered and in-flight groups, the data source's position) and nothing twice; along the
way its staleness stays within the bound, weight syncs interrupt and resume in-flight groups (every token keeps
the version that produced it), no request runs while weights load, and the staleness metrics reach TensorBoard.

One-step-ahead's checkpoint after rollout k holds rollout k+1, generated but not trained: the resumed run trains
exactly it, and the prompts of every rollout appear once over the two runs.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch

from slime.arguments import parse_args
from slime.scheduling.loop import LoopPlan
from tests.integration.test_resume import assets, run_slime  # noqa: F401,F811 - `assets` is a module fixture
from tests.loop_order import expected_events

pytestmark = [pytest.mark.cpu, pytest.mark.slow]

BATCH, N = 4, 2


def base_flags(toy: Path, run: Path, ckpt: Path, num_rollout: int) -> list[str]:
    return [
        "--hf-checkpoint", str(toy / "model"), "--prompt-data", str(toy / "data" / "train.jsonl"),
        "--input-key", "input", "--label-key", "label", "--apply-chat-template",
        "--custom-rm-path", "examples.toy.reward.reverse_digits_rm", "--rollout-engine", "sim",
        "--rollout-batch-size", str(BATCH), "--n-samples-per-prompt", str(N), "--num-rollout", str(num_rollout),
        "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1",
        "--rollout-max-response-len", "8", "--advantage-estimator", "reinforce_plus_plus",
        "--custom-megatron-init-path", "sim.fake_megatron.cpu_shim.apply", "--lr", "1e-3",
        "--save", str(ckpt), "--save-interval", "1", "--save-debug-rollout-data", str(run / "dump" / "{rollout_id}.pt"),
        "--sim-request-log-dir", str(run / "requests"), "--metrics-dir", str(run / "metrics"),
    ]  # fmt: skip


def moved(flags: list[str], old: Path, new: Path) -> list[str]:
    """The same job writing its dumps, request logs and metrics under `new` instead of `old`."""
    return [f.replace(str(old), str(new)) for f in flags]


def _dump(run: Path, rollout_id: int) -> list[dict]:
    return torch.load(run / "dump" / f"{rollout_id}.pt", weights_only=False)["samples"]


def _records(run: Path, kind: str) -> list[dict]:
    lines = (run / "metrics" / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def _requests(run: Path) -> list[dict]:
    return [json.loads(x) for f in sorted((run / "requests").glob("*.jsonl")) for x in f.read_text().splitlines()]


def test_fully_async_killed_with_groups_in_flight_resumes_losslessly(assets, tmp_path):  # noqa: F811
    cfg = tmp_path / "synthetic.yaml"
    cfg.write_text("output_len: {dist: uniform, low: 4, high: 8}\ntoken_latency_s: {dist: fixed, value: 0.3}\n")
    rollouts, k = 6, 1
    b, c, ckpt = tmp_path / "B", tmp_path / "C", tmp_path / "ckpt"
    flags = [
        *base_flags(assets, b, ckpt, rollouts), "--sim-engine", "synthetic", "--sim-synthetic-config", str(cfg),
        "--fully-async", "--max-weight-staleness", str(k), "--async-data-buffer-capacity-factor", "3",
    ]  # fmt: skip
    rc = run_slime(flags, b, kill_when=ckpt / "iter_0000003.tmp")  # checkpoint 2 is complete, 3 is being written
    assert rc == -signal.SIGKILL
    state = json.loads((ckpt / "iter_0000002" / "rollout" / "fully_async_2.json").read_text())
    assert state["in_flight"], "the checkpoint should hold groups in flight (the engines are slow on purpose)"
    assert len(state["consumed_ids"]) == 3 * BATCH

    resumed = [*moved(flags, b, c), "--load", str(ckpt)]
    run_slime(resumed, c)
    summary = json.loads((c / "metrics" / "summary.json").read_text())
    assert summary["resumed_from"] == 2
    assert summary["events"][:3] == [["sync", 3], ["start_producer", 3], ["consume", 3]]
    assert [tuple(e) for e in summary["events"]] == expected_events(LoopPlan.from_args(parse_args(resumed), 3))
    final = json.loads(
        (ckpt / f"iter_{rollouts - 1:07d}" / "rollout" / f"fully_async_{rollouts - 1}.json").read_text()
    )
    source = json.loads(
        (ckpt / f"iter_{rollouts - 1:07d}" / "rollout" / f"global_dataset_state_dict_{rollouts - 1}.json").read_text()
    )
    consumed, dropped = final["consumed_ids"], final["dropped_ids"]
    assert consumed[: len(state["consumed_ids"])] == state["consumed_ids"]
    assert len(consumed) == len(set(consumed)) == rollouts * BATCH, "a prompt trained twice"

    def indices(groups: list) -> list[int]:
        return [(g[0][0] if isinstance(g[0], list) else g[0])["group_index"] for g in groups]

    rest = indices(final["buffer"]) + indices(final["in_flight"]) + indices(source["buffer"])
    everything = consumed + dropped + rest
    assert len(everything) == len(set(everything))
    assert set(everything) == set(range(source["sample_group_index"])), "a prompt was lost"

    # the resumed run: staleness within the bound, syncs interrupted in-flight groups, metrics in TensorBoard
    rollout_metrics = [r["metrics"] for r in _records(c, "rollout")]
    assert [r["step"] for r in _records(c, "rollout")] == list(range(3, rollouts))
    assert all(m["async/staleness_max"] <= k for m in rollout_metrics)
    assert sum(m["async/aborted_groups"] for m in rollout_metrics) > 0
    for rid in range(3, rollouts):
        for s in _dump(c, rid):
            versions = [int(v) for v, _, _ in s["weight_version_spans"]]
            assert versions == sorted(versions) and versions[-1] <= rid
            assert sum(n for _, n, _ in s["weight_version_spans"]) == s["response_length"]
            assert rid - min(versions) <= k
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(c / "metrics" / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"rollout/async/staleness_max", "rollout/async/buffer_size", "rollout/async/trainer_wait_s"} <= tags

    # weights load while no request runs: every /generate ends before the engine pauses or starts after it resumes
    requests = _requests(c)
    pauses = [r for r in requests if r["endpoint"] == "/pause_generation"]
    resumes = [r for r in requests if r["endpoint"] == "/continue_generation"]
    assert pauses and len(pauses) == len(resumes)
    for p, q in zip(pauses, resumes, strict=True):
        for g in (r for r in requests if r["endpoint"] == "/generate"):
            assert g["ts_end"] <= p["ts_start"] or g["ts_start"] >= q["ts_end"], (g, p, q)


def test_one_step_ahead_killed_after_a_checkpoint_trains_the_rollout_it_had_generated(assets, tmp_path):  # noqa: F811
    rollouts = 4
    b, c, ckpt = tmp_path / "B", tmp_path / "C", tmp_path / "ckpt"
    flags = [*base_flags(assets, b, ckpt, rollouts), "--sim-engine", "hf", "--one-step-ahead"]
    rc = run_slime(flags, b, kill_when=ckpt / "iter_0000002.tmp")  # checkpoint 1 is complete, 2 is being written
    assert rc == -signal.SIGKILL
    pending = torch.load(ckpt / "iter_0000001" / "rollout" / "pending_1.pt", weights_only=False)
    assert list(pending) == [2]  # rollout 2 was generated while rollout 1 trained
    ahead = sorted({s["group_index"] for s in pending[2][0]})

    resumed = [*moved(flags, b, c), "--load", str(ckpt)]
    run_slime(resumed, c)
    summary = json.loads((c / "metrics" / "summary.json").read_text())
    assert summary["resumed_from"] == 1
    assert summary["events"][:3] == [["sync", 2], ["rollout", 2], ["train_data", 2]]
    assert [tuple(e) for e in summary["events"]] == expected_events(LoopPlan.from_args(parse_args(resumed), 2))
    assert sorted({s["group_index"] for s in _dump(c, 2)}) == ahead  # trained as generated, not regenerated
    prompts = [s["group_index"] for rid in (0, 1) for s in _dump(b, rid) if s["index"] % N == 0]
    prompts += [s["group_index"] for rid in range(2, rollouts) for s in _dump(c, rid) if s["index"] % N == 0]
    assert sorted(prompts) == list(range(rollouts * BATCH)), "a prompt was lost or trained twice"
    for m in (r["metrics"] for r in _records(c, "rollout")):
        assert m["async/staleness_max"] == 1.0  # every batch is one weight version old
