"""Exact resume and the colocated offload protocol, through the real `slime train` CLI (docs/checkpointing.md).

Three runs of the same colocated job (1 trainer rank, DP=1, fp32; 1 fake `hf` engine; 10 prompts per rollout,
1 sample each, 4 groups per step — so 2 groups are carried over after rollout 0):

- A: uninterrupted, 3 rollouts, a checkpoint and an HF export after every rollout;
- B: the same job, SIGKILLed while it writes the checkpoint of rollout 1 (its `iter_0000001.tmp` exists);
- C: `--load` B's checkpoint dir: the tracker still names rollout 0, so C starts at rollout 1.

C must regenerate A's rollouts 1 and 2 token for token (per-sample sampling seeds, restored data-source
position and carried-over groups) and end each with weights bit-identical to A's (restored model, Adam state,
LR schedule and RNG). A's engine request log and trainer events show the offload order of
docs/architecture.md#colocated-offload.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import torch

from examples.toy.prepare import prepare
from sim.slime_run import slime_train
from slime.arguments import parse_args
from slime.scheduling.loop import LoopPlan
from tests.loop_order import expected_events

pytestmark = [pytest.mark.cpu, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
NUM_ROLLOUT = 3


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("resume")
    prepare(out, num_train=64, num_eval=4)  # in-process: ~0.02 s, not a ~6 CPU-s interpreter
    return out


def job_flags(assets: Path, run: Path, ckpt: Path) -> list[str]:
    return [
        "--hf-checkpoint", str(assets / "model"), "--prompt-data", str(assets / "data" / "train.jsonl"),
        "--input-key", "input", "--label-key", "label", "--apply-chat-template",
        "--custom-rm-path", "examples.toy.reward.reverse_digits_rm", "--rollout-engine", "sim", "--sim-engine", "hf",
        "--rollout-batch-size", "10", "--n-samples-per-prompt", "1", "--global-batch-size", "4",
        "--num-rollout", str(NUM_ROLLOUT), "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1", "--colocate",
        "--rollout-max-response-len", "8", "--rollout-shuffle", "--advantage-estimator", "reinforce_plus_plus",
        "--custom-megatron-init-path", "sim.fake_megatron.cpu_shim.apply", "--lr", "1e-3", "--entropy-coef", "0.01",
        "--save", str(ckpt), "--save-interval", "1", "--save-hf", str(run / "hf" / "{rollout_id}"),
        "--save-debug-rollout-data", str(run / "dump" / "{rollout_id}.pt"),
        "--sim-request-log-dir", str(run / "requests"), "--metrics-dir", str(run / "metrics"),
        "--sglang-enable-deterministic-inference",
    ]  # fmt: skip


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the driver's whole tree (Ray daemons included), then wait until every process is gone.

    The driver's group is stopped first, in one call: the driver renames the finished save, so it cannot
    complete a save while its tree is collected (that took long enough under load to miss the window)."""
    try:
        os.killpg(proc.pid, signal.SIGSTOP)
    except ProcessLookupError:
        pass
    try:
        procs = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        procs = []
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=30)
    proc.wait(timeout=30)


def run_slime(argv: list[str], run: Path, kill_when: Path | None = None, timeout: float = 600) -> int:
    """Run `slime train`; with `kill_when`, SIGKILL it as soon as that path exists. Returns the exit code."""
    (run / "requests").mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with slime_train(argv, run / "driver.log", env) as proc:
        deadline = time.monotonic() + timeout
        while proc.poll() is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"slime train did not finish in {timeout}s")
            if kill_when is not None and kill_when.exists():
                _kill_tree(proc)
                return -signal.SIGKILL
            time.sleep(0.02)
    rc = proc.returncode
    assert rc == 0 or kill_when is not None, (run / "driver.log").read_text()[-6000:]
    return rc


def _tokens(run: Path, rollout_id: int) -> list[list[int]]:
    data = torch.load(run / "dump" / f"{rollout_id}.pt", weights_only=False)
    return [s["tokens"] for s in sorted(data["samples"], key=lambda s: s["index"])]


def _weights(run: Path, rollout_id: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    d = run / "hf" / str(rollout_id)
    return {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(f).items()}


def _requests(run: Path) -> list[dict]:
    (log,) = (run / "requests").glob("engine_*.jsonl")
    return [json.loads(x) for x in log.read_text().splitlines() if x.strip()]


def test_kill_during_save_resumes_exactly_and_offload_order(assets, tmp_path):
    a, b, c = tmp_path / "A", tmp_path / "B", tmp_path / "C"
    run_slime(job_flags(assets, a, a / "ckpt"), a)
    rc = run_slime(job_flags(assets, b, b / "ckpt"), b, kill_when=b / "ckpt" / "iter_0000001.tmp")
    assert rc == -signal.SIGKILL
    # killed during the save of rollout 1: the tracker still names the complete checkpoint of rollout 0
    assert (b / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "0"
    assert not (b / "ckpt" / "iter_0000001").exists()
    assert _tokens(b, 0) == _tokens(a, 0)
    carried = json.loads((b / "ckpt" / "iter_0000000" / "rollout" / "carry_0.json").read_text())
    assert len(carried["groups"]) == 2  # 10 groups, steps of 4: two wait for rollout 1

    run_slime([*job_flags(assets, c, b / "ckpt"), "--load", str(b / "ckpt")], c)
    summary = json.loads((c / "metrics" / "summary.json").read_text())
    assert summary["resumed_from"] == 0 and sorted(summary["hashes"]) == ["1", "2"]
    assert not (b / "ckpt" / "iter_0000001.tmp").exists()  # the stale save was cleaned up
    assert (b / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    ref = json.loads((a / "metrics" / "summary.json").read_text())
    for rid in (1, 2):
        assert _tokens(c, rid) == _tokens(a, rid), f"rollout {rid} differs after resume"
        # the same samples train, carried-over groups included (12 in rollout 1: 2 carried + 10 new); the train
        # data's hash may differ only in engine log-probs (~5e-7: the fake batches requests differently)
        assert summary["metrics"][str(rid)]["train/samples"] == ref["metrics"][str(rid)]["train/samples"]
        wa, wc = _weights(a, rid), _weights(c, rid)
        assert wa.keys() == wc.keys()
        diff = [k for k in wa if not torch.equal(wa[k], wc[k])]
        assert not diff, f"rollout {rid}: weights differ in {diff[:5]}"
    assert ref["metrics"]["1"]["train/samples"] == 12.0
    assert not torch.equal(_weights(a, 1)["model.norm.weight"], _weights(a, 2)["model.norm.weight"])  # it trains

    check_offload_order(_requests(a), ref["offload_events"])
    # the driver ran the one loop's colocated order (engines released and resumed around every step), resumed too
    for run, start, summ in ((a, 0, ref), (c, 1, summary)):
        flags = job_flags(assets, run, b / "ckpt" if run == c else a / "ckpt")
        assert [tuple(e) for e in summ["events"]] == expected_events(LoopPlan.from_args(parse_args(flags), start))


def check_offload_order(requests: list[dict], trainer_events: list) -> None:
    """The colocated offload order on one engine: released after every rollout, weights back before the sync, KV after.

    Engine states follow its release/resume calls; the trainer may only be awake while the engine is fully
    released, and weights may only be pushed while the engine holds its weights but no KV cache yet.
    """
    memory = [r for r in requests if r["endpoint"] in ("/release_memory_occupation", "/resume_memory_occupation")]
    kinds = [("release" if r["endpoint"].startswith("/release") else "resume", r["body"].get("tags")) for r in memory]
    per_phase = [("release", None), ("resume", ["weights"]), ("resume", ["kv_cache", "cuda_graph"])]
    assert kinds == per_phase * (NUM_ROLLOUT + 1), kinds  # start-up + one cycle per rollout
    for r in requests:  # flush before each release (SGLangEngine.release_memory_occupation)
        if r["endpoint"] == "/release_memory_occupation":
            before = [x for x in requests if x["ts_end"] <= r["ts_start"]]
            assert before[-1]["endpoint"] == "/flush_cache"

    def engine_state(t: float) -> tuple[str, object]:
        done = [k for r, k in zip(memory, kinds, strict=True) if r["ts_end"] <= t]
        return done[-1] if done else ("resume", None)

    loads = [r for r in requests if r["endpoint"] == "/update_weights_from_tensor"]
    assert loads and all(engine_state(r["ts_start"]) == ("resume", ["weights"]) for r in loads)
    gens = [r for r in requests if r["endpoint"] == "/generate"]
    assert gens and all(engine_state(r["ts_start"]) == ("resume", ["kv_cache", "cuda_graph"]) for r in gens)
    names = [name for _, name in trainer_events]
    assert names[0] == "sleep" and names.count("wake_up") == names.count("sleep") - 1
    for t, name in trainer_events:
        if name == "wake_up":
            assert engine_state(t) == ("release", None), (t, name)
        if name == "update_weights":
            assert engine_state(t) == ("resume", ["weights"]), (t, name)
