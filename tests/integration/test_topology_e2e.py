"""Acceptance of the multi-model example (examples/sglang_config): `slime train --debug-rollout-only` with an
actor served prefill/decode-disaggregated (1 prefill + 2 decode), a frozen reference model and a 2-engine
reward model, each behind its own real sglang-router; then `--debug-train-only` replaying the dump with no
engine or router at all. Processes are observed from outside with psutil; engine work from the fakes' logs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from sim.process_tree import ProcessTreeWatcher

pytestmark = [pytest.mark.cpu, pytest.mark.slow, pytest.mark.xdist_group("cluster")]

CPU_SHIM = "sim.fake_megatron.cpu_shim.apply"
ROOT = Path(__file__).resolve().parents[2]
EX = ROOT / "examples" / "sglang_config"
BATCH, N_SAMPLES = 4, 2


def run_slime(argv: list[str], out: Path, timeout: float = 600) -> tuple[dict, ProcessTreeWatcher]:
    cmd = [sys.executable, "-m", "slime.cli", "train", *argv, "--metrics-dir", str(out)]
    log_path = out.parent / f"{out.name}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        tree = ProcessTreeWatcher(proc.pid)
        try:
            rc = proc.wait(timeout=timeout)
        finally:
            tree.stop()
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    assert rc == 0, log_path.read_text()[-6000:]
    return json.loads((out / "summary.json").read_text()), tree


def read_logs(log_dir: Path) -> dict[int, list[dict]]:
    return {
        int(f.stem.split("_")[1]): [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
        for f in log_dir.glob("engine_*.jsonl")
    }


def test_example_topology_rollout_then_train_only(tmp_path):
    assets = tmp_path / "assets"
    subprocess.run([sys.executable, "-m", "examples.toy.prepare", "--out", str(assets), "--num-train", "16",
                    "--num-eval", "2"], check=True, cwd=ROOT, timeout=300)  # fmt: skip
    dump = tmp_path / "dump" / "rollout_{rollout_id}.pt"
    logs = tmp_path / "engine_logs"
    logs.mkdir()
    base = [
        "--rollout-batch-size", str(BATCH), "--n-samples-per-prompt", str(N_SAMPLES), "--num-rollout", "1",
        "--global-batch-size", str(BATCH * N_SAMPLES), "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1",
        "--rollout-max-response-len", "16", "--hf-checkpoint", str(assets / "model"),
    ]  # fmt: skip
    rollout = [
        "--prompt-data", str(assets / "data" / "train.jsonl"), "--input-key", "input", "--label-key", "label",
        "--apply-chat-template", "--custom-rm-path", "examples.sglang_config.reward.reward_model_rm",
        "--sglang-config", str(EX / "sglang_config.yaml"), "--rollout-num-gpus", "6", "--rollout-engine", "sim",
        "--sim-engine", "scripted", "--sim-script", str(EX / "policy_script.yaml"), "--sim-request-log-dir", str(logs),
    ]  # fmt: skip
    summary, tree = run_slime([*base, *rollout, "--debug-rollout-only", "--save-debug-rollout-data", str(dump)],
                              tmp_path / "rollout")  # fmt: skip

    info = summary["server_info"]
    assert sorted(info["routers"]) == ["actor", "ref", "reward"] and info["routers"]["actor"]["pd"] is True
    assert [(e["model"], e["worker_type"]) for e in info["engines"]] == [
        ("actor", "prefill"), ("actor", "decode"), ("actor", "decode"), ("ref", "regular"),
        ("reward", "regular"), ("reward", "regular"),
    ]  # fmt: skip
    # three real routers (sglang_router retitles itself sglang::router) and six fake engines were running
    assert tree.count("sglang::router") == 3 and tree.count("sim.fake_sglang") == 6
    # --debug-rollout-only: no process initialised torch.distributed
    assert info["dist_initialized"] is False and all(not s["dist_initialized"] for s in summary["train_status"])

    by_rank = read_logs(logs)
    model_of = {e["rank"]: e["model"] for e in info["engines"]}
    kind_of = {e["rank"]: e["worker_type"] for e in info["engines"]}
    gens = {r: [x for x in recs if x["endpoint"] == "/generate"] for r, recs in by_rank.items()}
    prefill_rooms = Counter(x["bootstrap_room"] for r, xs in gens.items() if kind_of[r] == "prefill" for x in xs)
    decode = [x for r, xs in gens.items() if kind_of[r] == "decode" for x in xs]
    total = BATCH * N_SAMPLES
    assert len(decode) == total and all(x["status"] == 200 for x in decode)
    # every decode request was paired with exactly one prefill request, and every prefill with a decode
    assert all(prefill_rooms[x["bootstrap_room"]] == 1 for x in decode)
    assert set(prefill_rooms) == {x["bootstrap_room"] for x in decode}
    # every reward came from the reward model's engines, one judge call per sample; none elsewhere
    judged = [x for r, xs in gens.items() for x in xs if "Score the response" in json.dumps(x["body"])]
    assert len(judged) == total and {model_of[r] for r, xs in gens.items() for x in xs if x in judged} == {"reward"}
    assert all(not gens.get(r) for r, m in model_of.items() if m == "ref")  # frozen ref: served, not used here

    import torch

    samples = torch.load(str(dump).format(rollout_id=0), weights_only=False)["samples"]
    assert len(samples) == total
    for s in samples:
        assert s["reward"] == (1.0 if "4321" in s["response"] else 0.25)

    # --debug-train-only (replaying the dump): not one engine or router process, no listener but Ray's
    replay_flags = ["--load-debug-rollout-data", str(dump), "--custom-megatron-init-path", CPU_SHIM]
    replay, tree = run_slime([*base, *replay_flags], tmp_path / "train_only")
    assert replay["server_info"]["engine_pids"] == [] and replay["server_info"]["router_pid"] is None
    assert tree.cmdlines and tree.count("sglang") == 0 and tree.count("fake_sglang") == 0
    ray_words = ("ray", "gcs_server", "raylet", "default_worker")
    for pid, ports in tree.listeners.items():
        if ports and pid != tree.root.pid:
            assert any(k in tree.cmdlines.get(pid, "") for k in ray_words), (tree.cmdlines.get(pid), ports)
    assert all(s["dist_initialized"] for s in replay["train_status"])  # training did run
