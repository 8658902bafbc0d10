"""`examples/fan_out/` trains on CPU: each trajectory fans out into 1-4 segments (simulated compaction), the number
of samples per step varies while the number of groups per optimizer step stays constant.

Runs the example's own launch script (`slime train` through Ray, the real sglang-router and one `hf` fake
engine) for 3 rollouts, then reads `metrics.jsonl`, the rollout dumps and the engine's request log.
"""

from __future__ import annotations

import collections
import json
import os
from pathlib import Path

import pytest
import torch

from sim.slime_run import supervised

pytestmark = [pytest.mark.cpu, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
NUM_ROLLOUT = 3
GROUPS = 16  # --rollout-batch-size 4 × --n-samples-per-prompt 4 (the script's values)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fan_out")
    env = {**os.environ, "OUT": str(out)}
    (out / "requests").mkdir()  # slime does not create --sim-request-log-dir itself
    # seeded sampling (SGLang honours sampling_seed only in deterministic mode): the same answers on every run, some
    # of which the random model gets partly right, so the run has a reward to learn from
    extra = ["--num-rollout", str(NUM_ROLLOUT), "--sim-request-log-dir", str(out / "requests"),
             "--sglang-enable-deterministic-inference"]  # fmt: skip
    with supervised(["bash", str(ROOT / "examples/fan_out/run_fan_out.sh"), *extra], out / "run.log", env) as proc:
        rc = proc.wait(timeout=600)
    assert rc == 0, (out / "run.log").read_text()[-6000:]
    return out


def _metrics(run: Path, kind: str) -> list[dict]:
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [r["metrics"] for r in sorted((r for r in lines if r["kind"] == kind), key=lambda r: r["step"])]


def _dump(run: Path, rollout_id: int) -> list[dict]:
    return torch.load(run / "dump" / f"rollout_{rollout_id}.pt", weights_only=False)["samples"]


def test_samples_per_step_vary_while_groups_per_step_stay_constant(run):
    train, rollout = _metrics(run, "train"), _metrics(run, "rollout")
    assert len(train) == len(rollout) == NUM_ROLLOUT
    samples = [m["train/samples"] for m in train]
    assert [m["train/global_batch_size"] for m in train] == [float(GROUPS)] * NUM_ROLLOUT
    assert len(set(samples)) > 1, samples  # fan-out changes the sample count from step to step
    assert all(GROUPS < n <= 4 * GROUPS for n in samples), samples
    assert samples == [m["rollout/num_samples"] for m in rollout]  # nothing dropped, carried or padded
    assert all(m["train/deferred_groups"] == 0 and m["train/num_steps"] == 1 for m in rollout)
    assert all(m["train/update_successful"] == 1.0 for m in train)
    assert any(m["train/grad_norm"] > 0 for m in train)  # it trains (a zero-reward rollout has no gradient)
    # the engine's log-probs match the trainer's recompute on every segment's own (compacted) context
    assert all(m["train/train_rollout_logprob_abs_diff_max"] < 1e-3 for m in train)


def test_segments_form_one_group_per_trajectory(run):
    total = 0
    for rid in range(NUM_ROLLOUT):
        samples = _dump(run, rid)
        total += len(samples)
        groups = collections.defaultdict(list)
        for s in samples:
            groups[s["group_id"]].append(s)
        assert len(groups) == GROUPS
        sizes = [len(g) for g in groups.values()]
        assert set(sizes) <= {1, 2, 3, 4} and len(set(sizes)) > 1, sizes
        for segs in groups.values():
            k = len(segs)
            assert [s["metadata"]["segment_idx"] for s in segs] == list(range(k))
            assert all(s["metadata"]["num_segments"] == k for s in segs)
            assert len({json.dumps(s["reward"]) for s in segs}) == 1  # one trajectory, one reward
            assert len({s["group_index"] for s in segs}) == 1
            first = segs[0]
            prompt = first["tokens"][: len(first["tokens"]) - first["response_length"]]
            for s in segs:
                assert len(s["rollout_log_probs"]) == s["response_length"] == len(s["loss_mask"]) > 0
            for s in segs[1:]:  # a compacted context: the original prompt plus a short tail, never the whole history
                assert s["tokens"][: len(prompt)] == prompt
                assert len(s["tokens"]) - s["response_length"] <= len(prompt) + 3
    # every segment is one engine call: the fake engine's request log counts them
    gens = []
    for f in (run / "requests").glob("*.jsonl"):
        gens += [json.loads(x) for x in f.read_text().splitlines() if '"/generate"' in x]
    assert len(gens) == total, (len(gens), total)
