"""`--rollout-external`: slime attaches to inference servers it did not start. Nothing is launched but the router
in front of them; rollouts go through that router, and weight sync reaches the external server (a broadcast
group it joins over HTTP, as SGLang does). The server is a fake `hf` engine this test starts itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from examples.toy.prepare import prepare
from sim.fake_sglang.testing import launch_fake_sglang
from sim.process_tree import ProcessTreeWatcher

pytestmark = [pytest.mark.cpu, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("toy")
    prepare(out, num_train=32, num_eval=4)  # in-process: ~0.02 s, not a ~6 CPU-s interpreter
    return out


def test_attaches_to_running_servers(assets: Path, tmp_path: Path) -> None:
    request_log = tmp_path / "external.jsonl"
    fake = ["--engine", "hf", "--model-path", str(assets / "model"), "--request-log", str(request_log)]
    with launch_fake_sglang(fake) as server:
        metrics = tmp_path / "run"
        cmd = [
            sys.executable, "-m", "slime.cli", "train", "--rollout-external",
            "--rollout-external-engine-addrs", server.url.removeprefix("http://"),
            "--hf-checkpoint", str(assets / "model"), "--prompt-data", str(assets / "data" / "train.jsonl"),
            "--input-key", "input", "--label-key", "label", "--apply-chat-template",
            "--custom-rm-path", "examples.toy.reward.reverse_digits_rm",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--num-rollout", "2",
            "--global-batch-size", "4", "--rollout-max-response-len", "6",
            "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1", "--lr", "1e-3",
            "--custom-megatron-init-path", "sim.fake_megatron.cpu_shim.apply", "--check-weight-update-equal",
            "--metrics-dir", str(metrics),
        ]  # fmt: skip
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        watcher = ProcessTreeWatcher(proc.pid)
        try:
            out, _ = proc.communicate(timeout=900)
        finally:
            watcher.stop()
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 0, out[-6000:]
        summary = json.loads((metrics / "summary.json").read_text())
        assert server.proc.poll() is None  # slime does not stop what it did not start

    # nothing launched but the router
    assert watcher.count("sim.fake_sglang") == 0
    assert watcher.count("sglang_router") + watcher.count("sglang::router") >= 1
    engines = summary["server_info"]["engines"]
    assert [(e["worker_type"], e["url"]) for e in engines] == [("external", server.url)]
    # rollouts reached the external server through the router, and every sync loaded weights there
    requests = [json.loads(line) for line in request_log.read_text().splitlines()]
    paths = [r["endpoint"] for r in requests]
    assert paths.count("/generate") >= 8
    assert paths.count("/init_weights_update_group") == 1
    assert paths.count("/update_weights_from_distributed") >= 3  # initial sync + one per rollout
    for rid in ("0", "1"):
        m = summary["metrics"][rid]
        assert m["train/update_successful"] == 1.0 and m["weight_sync/checked_engines"] == 1.0
