"""Acceptance of the walking skeleton: the toy job through Ray, the real sglang-router and 2 `hf` fake engines,
then a replay of its rollout dump that must reach the train actors bit-identically without any inference
process, then `--debug-rollout-only` without any torch.distributed process group.

Every run is the real `slime train` CLI in a subprocess; processes are observed from outside with psutil.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import time
from collections import Counter
from pathlib import Path

import psutil
import pytest

from examples.toy.prepare import prepare
from sim.process_tree import ProcessTreeWatcher
from sim.slime_run import slime_train
from slime.scheduling.loop import STEP_PHASES

pytestmark = [pytest.mark.cpu, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
NUM_ROLLOUT = 3


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("toy")
    prepare(out, num_train=64, num_eval=8)  # in-process: ~0.02 s, not a ~6 CPU-s interpreter
    return out


def toy_flags(assets: Path) -> list[str]:
    return [
        "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--num-rollout", str(NUM_ROLLOUT),
        "--global-batch-size", "16", "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1",
        "--rollout-max-response-len", "10", "--rollout-shuffle",
        "--custom-megatron-init-path", "sim.fake_megatron.cpu_shim.apply", "--lr", "1e-4", "--entropy-coef", "0.001",
    ]  # fmt: skip


def rollout_flags(assets: Path) -> list[str]:
    return [
        "--hf-checkpoint", str(assets / "model"), "--prompt-data", str(assets / "data" / "train.jsonl"),
        "--input-key", "input", "--label-key", "label", "--apply-chat-template",
        "--custom-rm-path", "examples.toy.reward.reverse_digits_rm",
        "--rollout-num-gpus", "2", "--rollout-engine", "sim", "--sim-engine", "hf",
    ]  # fmt: skip


def run_slime(
    argv: list[str], metrics: Path, on_running=None, timeout: float = 600, listeners: bool = False
) -> tuple[dict, ProcessTreeWatcher]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with slime_train([*argv, "--metrics-dir", str(metrics)], metrics.parent / f"{metrics.name}.log", env) as proc:
        watcher = ProcessTreeWatcher(proc.pid, listeners=listeners)
        try:
            if on_running is not None:
                on_running(proc)
            rc = proc.wait(timeout=timeout)
        finally:
            watcher.stop()
    out = (metrics.parent / f"{metrics.name}.log").read_text()
    assert rc == 0, out[-6000:]
    return json.loads((metrics / "summary.json").read_text()), watcher


def check_router_identity(metrics: Path):
    def check(proc: subprocess.Popen) -> None:
        deadline = time.monotonic() + 300
        servers = metrics / "servers.json"
        while not servers.exists():
            assert proc.poll() is None, "slime exited before its servers came up"
            assert time.monotonic() < deadline
            time.sleep(0.3)
        info = json.loads(servers.read_text())
        router = psutil.Process(info["router_pid"])
        # sglang_router retitles its process "sglang::router"; its Rust extension must be mapped into it.
        assert "sglang_router" in " ".join(router.cmdline()) or router.name().startswith("sglang::router")
        assert any("sglang_router" in m.path for m in router.memory_maps())
        assert importlib.metadata.version("sglang-router") == "0.3.2"
        assert len(info["engine_pids"]) == 2
        for pid in info["engine_pids"]:
            assert "sim.fake_sglang" in " ".join(psutil.Process(pid).cmdline())
        check.info = info

    return check


_NOISE = re.compile(r"^\S+ \S+ |\(pid=\d+\)|\(\w+ pid=\d+[^)]*\)|\d+(\.\d+)?")  # times, pids, numbers


def check_quiet_console(console: str) -> None:
    """No warning line shows twice (once per actor was the failure) and the known harmless megatron fallbacks
    (Apex / TransformerEngine) are filtered; one line per rollout reports progress."""
    warnings = [_NOISE.sub("", x).strip() for x in console.splitlines() if re.search(r"(?i)warn", x)]
    repeated = {w: n for w, n in Counter(warnings).items() if n > 1}
    assert not repeated, repeated
    assert not re.search(r"Apex is not installed|TransformerEngine|transformer_engine", console), console[-3000:]
    progress = [x for x in console.splitlines() if re.search(r"rollout \d+/\d+ \|", x)]
    assert len(progress) == NUM_ROLLOUT, console[-3000:]


def is_ray_process(cmd: str) -> bool:
    return any(k in cmd for k in ("ray", "gcs_server", "raylet", "default_worker"))


def test_toy_train_replay_and_rollout_only(assets, tmp_path):
    dump = tmp_path / "dump" / "rollout_{rollout_id}.pt"
    base = toy_flags(assets)

    # 1. the toy job: real router + 2 hf engines, dumping every rollout
    check = check_router_identity(tmp_path / "run")
    live, live_tree = run_slime(
        [*base, *rollout_flags(assets), "--save-debug-rollout-data", str(dump)], tmp_path / "run", check
    )
    assert sorted(int(k) for k in live["hashes"]) == list(range(NUM_ROLLOUT))
    # real optimizer steps happened and the engines received every update
    for rid in range(NUM_ROLLOUT):
        m = live["metrics"][str(rid)]
        assert m["train/grad_norm"] > 0 and m["train/update_successful"] == 1.0
        assert m["weight_sync/buckets"] >= 1
        # the step's top-level phases do not overlap: they add up to no more than its wall time
        phases = [m[k] for k in STEP_PHASES if k in m]
        assert {"time/rollout", "time/train_total", "time/weight_sync"} <= set(m) and min(phases) >= 0
        assert sum(phases) <= m["time/step"] + 1e-6 and m["time/unaccounted"] >= -1e-6
    assert all(json.loads((tmp_path / "run" / "servers.json").read_text())["engine_pids"])
    engine_cmds = [c for c in live_tree.cmdlines.values() if "sim.fake_sglang" in c]
    assert len(engine_cmds) == 2 and any(
        "sglang_router" in c or "sglang::router" in c for c in live_tree.cmdlines.values()
    )
    rollout_lines = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if line.strip()
    ]
    assert [r["step"] for r in rollout_lines if r["kind"] == "rollout"] == list(range(NUM_ROLLOUT))
    assert list((tmp_path / "run" / "tb").iterdir()), "no TensorBoard events"
    for i in range(NUM_ROLLOUT):
        assert Path(str(dump).format(rollout_id=i)).is_file()
    # every server process is gone after the run
    for pid, cmd in live_tree.cmdlines.items():
        if "sim.fake_sglang" in cmd or "sglang_router" in cmd or "sglang::router" in cmd:
            assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE

    check_quiet_console((tmp_path / "run.log").read_text())

    # 2. replay: same hashes, no engine or router process, no listener outside Ray's own
    replay_flags = ["--load-debug-rollout-data", str(dump), "--hf-checkpoint", str(assets / "model")]
    replay, tree = run_slime([*base, *replay_flags], tmp_path / "replay", listeners=True)
    assert replay["hashes"] == live["hashes"]
    assert replay["server_info"]["router_pid"] is None and replay["server_info"]["engine_pids"] == []
    cmds = list(tree.cmdlines.values())
    assert cmds and not [c for c in cmds if "fake_sglang" in c or "sglang_router" in c or "sglang" in c]
    for pid, ports in tree.listeners.items():
        if ports and pid != tree.root.pid:  # the driver itself hosts Ray's core worker
            assert is_ray_process(tree.cmdlines.get(pid, "")), (tree.cmdlines.get(pid), ports)

    # 3. inference alone: rollouts complete, no process initialised torch.distributed
    only, _ = run_slime([*base, *rollout_flags(assets), "--debug-rollout-only"], tmp_path / "rollout_only")
    assert only["hashes"] == {}
    assert only["server_info"]["dist_initialized"] is False
    assert only["train_status"] and all(not s["dist_initialized"] for s in only["train_status"])
    lines = (tmp_path / "rollout_only" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines if json.loads(x)["kind"] == "rollout"] == list(range(NUM_ROLLOUT))
    # and the normal run did initialise it (the check can fail)
    assert all(s["dist_initialized"] for s in live["train_status"])
