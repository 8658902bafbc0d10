"""`sim/fake_sglang/zygote.py`: fake engines forked from a pre-imported process behave as engines started
directly — they serve, stop on SIGTERM with exit 0, die when their launcher is killed, and never outlive it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from sim.fake_sglang import launch
from sim.fake_sglang import zygote as zy
from sim.fake_sglang.testing import fake_env
from slime.utils.http_utils import find_free_port

pytestmark = pytest.mark.cpu


@pytest.fixture(scope="module")
def own_zygote(tmp_path_factory: pytest.TempPathFactory):
    """A zygote of this module's own (the session's one may be off), up and listening."""
    with zy.zygote() as path:
        deadline = time.time() + 120
        while not os.path.exists(path):
            assert time.time() < deadline, "zygote did not start listening"
            time.sleep(0.2)
        (proc,) = [p for p in psutil.Process().children() if path in p.cmdline()]
        yield path, proc


def _start(path: str | None, tmp_path: Path) -> tuple[subprocess.Popen, str]:
    port = find_free_port(host="127.0.0.1")
    env = fake_env()
    env.pop(launch.ENV, None)
    if path is not None:
        env[launch.ENV] = path
    cmd = [
        sys.executable,
        "-m",
        "sim.fake_sglang",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--engine",
        "synthetic",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()
    assert line.startswith("fake_sglang ready"), line
    return proc, f"http://127.0.0.1:{port}"


def _engines(zygote_proc: psutil.Process) -> list[psutil.Process]:
    return zygote_proc.children()


def test_forked_engine_serves_and_stops_on_sigterm(own_zygote, tmp_path: Path) -> None:
    path, zproc = own_zygote
    launcher, url = _start(path, tmp_path)
    try:
        (engine,) = _engines(zproc)  # the server is the zygote's fork, not the launcher
        assert httpx.get(f"{url}/get_server_info", timeout=30).status_code == 200
        assert "sim.fake_sglang" in " ".join(psutil.Process(launcher.pid).cmdline())
        # the launcher bound the port and holds it: slime sees its own child listening there (wait_healthy)
        port = int(url.rsplit(":", 1)[1])
        listening = [c for c in psutil.Process(launcher.pid).net_connections() if c.status == psutil.CONN_LISTEN]
        assert [c.laddr.port for c in listening] == [port]
        launcher.send_signal(signal.SIGTERM)  # forwarded to the engine, which shuts down cleanly
        assert launcher.wait(timeout=30) == 0
        engine.wait(timeout=10)
        assert not _engines(zproc)
    finally:
        launcher.kill()


def test_engine_dies_with_its_killed_launcher(own_zygote, tmp_path: Path) -> None:
    path, zproc = own_zygote
    launcher, url = _start(path, tmp_path)
    (engine,) = _engines(zproc)
    launcher.kill()  # SIGKILL: no chance to forward anything
    launcher.wait(timeout=10)
    engine.wait(timeout=10)  # the engine saw its launcher's connection close
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{url}/get_server_info", timeout=2)


def test_without_a_zygote_the_launcher_is_the_engine(tmp_path: Path) -> None:
    launcher, url = _start(None, tmp_path)
    try:
        assert httpx.get(f"{url}/get_server_info", timeout=30).status_code == 200
        assert not psutil.Process(launcher.pid).children()
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=30) == 0
    finally:
        launcher.kill()


def test_cuda_multinode_engines_and_a_missing_zygote_run_directly(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(launch.ENV, str(tmp_path / "absent.sock"))
    assert launch.run_via_zygote(["--engine", "synthetic"]) is None  # nobody listens: run it here
    monkeypatch.setenv(launch.ENV, "0")
    assert launch.run_via_zygote(["--engine", "synthetic"]) is None
    monkeypatch.setenv(launch.ENV, str(tmp_path / "absent.sock"))
    assert launch.run_via_zygote(["--engine", "hf", "--device", "cuda"]) is None
    assert launch.run_via_zygote(["--engine", "synthetic", "--nnodes", "2", "--node-rank", "0"]) is None
