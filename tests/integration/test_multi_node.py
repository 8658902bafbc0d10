"""Two Ray nodes on one machine, each on its own loopback address: `slime train` spans both.

The head runs on 127.0.0.3 and a second node on 127.0.0.2 (a head asked for 127.0.0.1 is moved by Ray to the
machine's interface address, which a test must never use), one logical GPU each. The toy job trains with
`--actor-num-nodes 2` and one engine spanning both nodes (`--rollout-num-gpus-per-engine 2`, one server process
per node), colocated. psutil watches every process of the run from outside and proves:
- every socket slime opens on node 2 (engine servers, the train rank's rendezvous store and gloo transport)
  listens on 127.0.0.2; Ray's own gRPC servers listen on the wildcard address by Ray's design and are told
  apart by that;
- the process-group store listens on train rank 0's node address;
- no connection of any process of the run touches a non-loopback address;
- 2 rollouts train.
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest

from examples.toy.prepare import prepare
from slime.utils.http_utils import find_free_port

pytestmark = [pytest.mark.cpu, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
HEAD, NODE2 = "127.0.0.3", "127.0.0.2"
WILDCARD = {"0.0.0.0", "::"}
RAY = [sys.executable, "-m", "ray.scripts.scripts"]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "SLIME_NODE_ADDRESS"}
    return {
        **env,
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1",
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_AUTH_MODE": "disabled",
        # this test watches every engine's own sockets: engines run as children of their actors, not as forks of
        # the test session's zygote (sim/fake_sglang/zygote.py), which would take them out of the watched tree
        "SLIME_SIM_ZYGOTE": "0",
    }


def _loopback(ip: str) -> bool:
    return ipaddress.ip_address(ip.removeprefix("::ffff:")).is_loopback


class RunWatcher:
    """Samples every process of the two raylets' trees and of the driver: node, listeners, connections."""

    def __init__(self, roots: dict[int, str]) -> None:
        self.roots = roots  # pid -> node address (raylets and the driver)
        self.listeners: dict[int, set[tuple[str, int]]] = {}
        self.connections: set[tuple[int, str, str]] = set()
        self.node_of: dict[int, str] = {}
        self.cmdline: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            for root, node in list(self.roots.items()):
                try:
                    procs = [psutil.Process(root), *psutil.Process(root).children(recursive=True)]
                except psutil.Error:
                    continue
                for p in procs:
                    try:
                        conns = p.net_connections("inet")
                        self.node_of.setdefault(p.pid, node)
                        self.cmdline[p.pid] = " ".join(p.cmdline()) or self.cmdline.get(p.pid, "")
                    except psutil.Error:
                        continue
                    for c in conns:
                        if c.status == psutil.CONN_LISTEN:
                            self.listeners.setdefault(p.pid, set()).add((c.laddr.ip, c.laddr.port))
                        elif c.raddr:
                            self.connections.add((p.pid, c.laddr.ip, c.raddr.ip))
            time.sleep(0.3)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


@pytest.fixture
def two_node_cluster():
    temp = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: Ray's socket paths live under it
    port = find_free_port(host=HEAD)
    common = ["--num-gpus", "1", "--num-cpus", "4", "--temp-dir", temp, "--disable-usage-stats"]
    try:
        subprocess.run(
            [*RAY, "start", "--head", "--node-ip-address", HEAD, "--port", str(port), "--include-dashboard=false",
             *common], check=True, env=_env(), timeout=120, capture_output=True,
        )  # fmt: skip
        subprocess.run(
            [*RAY, "start", "--address", f"{HEAD}:{port}", "--node-ip-address", NODE2, *common],
            check=True, env=_env(), timeout=120, capture_output=True,
        )  # fmt: skip
        raylets = {}
        for p in psutil.process_iter(["cmdline"]):
            cmd = " ".join(p.info["cmdline"] or [])
            if "raylet" in cmd and temp in cmd:
                raylets[p.pid] = NODE2 if f"--node_ip_address={NODE2}" in cmd else HEAD
        assert sorted(raylets.values()) == [NODE2, HEAD], raylets
        yield f"{HEAD}:{port}", raylets
    finally:
        for p in psutil.process_iter(["cmdline"]):  # this cluster's processes only (others may run Ray)
            try:
                if temp in " ".join(p.info["cmdline"] or []):
                    for child in p.children(recursive=True):
                        child.kill()
                    p.kill()
            except psutil.Error:
                pass
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("toy")
    prepare(out, num_train=32, num_eval=4)  # in-process: ~0.02 s, not a ~6 CPU-s interpreter
    return out


def test_train_spans_two_nodes(two_node_cluster, assets: Path, tmp_path: Path) -> None:
    address, raylets = two_node_cluster
    metrics = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "slime.cli", "train", "--ray-address", address,
        "--hf-checkpoint", str(assets / "model"), "--prompt-data", str(assets / "data" / "train.jsonl"),
        "--input-key", "input", "--label-key", "label", "--apply-chat-template",
        "--custom-rm-path", "examples.toy.reward.reverse_digits_rm",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--num-rollout", "2", "--global-batch-size", "4",
        "--rollout-max-response-len", "6", "--colocate", "--num-gpus-per-node", "1",
        "--actor-num-nodes", "2", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus-per-engine", "2",
        "--rollout-engine", "sim", "--sim-engine", "hf", "--lr", "1e-4",
        "--custom-megatron-init-path", "sim.fake_megatron.cpu_shim.apply", "--metrics-dir", str(metrics),
    ]  # fmt: skip
    log = tmp_path / "run.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env={**_env(), "PYTHONPATH": str(ROOT)}, stdout=out, stderr=out)
    watcher = RunWatcher({**raylets, proc.pid: HEAD})
    try:
        rc = proc.wait(timeout=900)
    finally:
        watcher.stop()
        if proc.poll() is None:
            proc.kill()
    assert rc == 0, log.read_text()[-6000:]
    summary = json.loads((metrics / "summary.json").read_text())

    # 2 rollouts trained, on two ranks, one per node
    assert sorted(summary["hashes"]) == ["0", "1"]
    status = summary["train_status"]
    assert sorted(s["node_ip"] for s in status) == [NODE2, HEAD]
    # one engine spanning both nodes: a server process on each
    engine = summary["server_info"]["engines"][0]
    assert engine["nnodes"] == 2
    fakes = {pid: watcher.node_of[pid] for pid, cmd in watcher.cmdline.items() if "sim.fake_sglang" in cmd}
    assert sorted(fakes.values()) == [NODE2, HEAD], fakes

    # everything slime listens on, on node 2, is bound to node 2's address
    node2 = [pid for pid, node in watcher.node_of.items() if node == NODE2 and pid not in raylets]
    for pid in node2:
        bad = {(ip, port) for ip, port in watcher.listeners.get(pid, ()) if ip not in WILDCARD and ip != NODE2}
        assert not bad, f"{watcher.cmdline.get(pid)} listens on {bad}"
    rank0 = next(s for s in status if s["rank"] == 0)
    rdv_host, rdv_port = rank0["rendezvous"]
    assert rdv_host == rank0["node_ip"]
    assert (rank0["node_ip"], rdv_port) in watcher.listeners.get(rank0["pid"], set())
    # the engine's HTTP server listens on its node's address
    assert any(ip == watcher.node_of[pid] for pid in fakes for ip, _ in watcher.listeners.get(pid, ()))
    # no connection of the run leaves loopback
    outside = [
        (watcher.cmdline.get(pid, pid), la, ra)
        for pid, la, ra in watcher.connections
        if not (_loopback(la) and _loopback(ra))
    ]
    assert not outside, outside[:5]


def test_resource_check_answers_at_once(tmp_path: Path, assets: Path) -> None:
    """Asking for more GPUs than the cluster has is one line within seconds, not a wait and a traceback."""
    cmd = [
        sys.executable, "-m", "slime.cli", "train", "--hf-checkpoint", str(assets / "model"),
        "--prompt-data", str(assets / "data" / "train.jsonl"), "--input-key", "input",
        "--rollout-batch-size", "2", "--num-rollout", "1", "--actor-num-gpus-per-node", "4", "--rollout-num-gpus", "4",
        "--custom-megatron-init-path", "sim.fake_megatron.cpu_shim.apply", "--rollout-engine", "sim",
        "--ray-address", "local", "--metrics-dir", str(tmp_path / "m"),
    ]  # fmt: skip
    t0 = time.monotonic()
    out = subprocess.run(
        cmd, cwd=ROOT, env={**_env(), "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 2, out.stderr[-3000:]
    err = [line for line in out.stderr.splitlines() if line.startswith("slime: error:")]
    assert len(err) == 1 and "needs 8 GPUs" in err[0] and "has" in err[0], out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    assert time.monotonic() - t0 < 120  # includes Ray's start-up; the check itself is immediate
