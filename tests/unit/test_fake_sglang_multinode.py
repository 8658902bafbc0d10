"""A multi-node fake engine has SGLang's process shape: node rank 0 serves HTTP and is healthy only once every other
node rank joined it at --dist-init-addr; the other ranks listen on nothing and die with rank 0."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from sim.fake_sglang.__main__ import parse_args
from sim.fake_sglang.testing import fake_env
from slime.utils.http_utils import find_free_port
from slime.utils.process import die_with_parent, signal_group, stop_popen

pytestmark = pytest.mark.cpu

NODE0, NODE1 = "127.0.0.1", "127.0.0.2"  # two loopback addresses stand for two machines


def _node(rank: int, host: str, dist_init_addr: str, *extra: str, nnodes: int = 2) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "sim.fake_sglang", "--host", host, "--port", str(find_free_port(host=host))]
    cmd += ["--engine", "synthetic", "--nnodes", str(nnodes), "--node-rank", str(rank)]
    cmd += ["--dist-init-addr", dist_init_addr, *extra]
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=fake_env(), preexec_fn=die_with_parent
    )


def _url(proc: subprocess.Popen) -> str:
    args = proc.args
    return f"http://{args[args.index('--host') + 1]}:{args[args.index('--port') + 1]}"


def _listening(proc: subprocess.Popen) -> set[tuple[str, int]]:
    conns = psutil.Process(proc.pid).net_connections("inet")
    return {(c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN}


def _wait(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            got = check()
        except (httpx.HTTPError, psutil.Error):
            got = None
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _status(url: str) -> int:
    return httpx.get(url, timeout=5).status_code


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["--nnodes", "2"], "--nnodes 2 needs --dist-init-addr HOST:PORT"),
        (["--nnodes", "2", "--node-rank", "2", "--dist-init-addr", "127.0.0.1:5000"], "--node-rank 2 is not in [0,"),
        (["--node-rank", "-1"], "--node-rank -1 is not in [0,"),
        (["--nnodes", "0"], "--nnodes must be at least 1"),
        (["--nnodes", "2", "--dist-init-addr", "127.0.0.1"], "--dist-init-addr: expected HOST:PORT"),
    ],
)
def test_multinode_flags_are_checked_with_one_line_errors(capsys, argv, error):
    with pytest.raises(SystemExit) as e:
        parse_args(["--port", "1", "--engine", "synthetic", *argv])
    assert e.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("python -m sim.fake_sglang: error: ") and error in last


def test_defaults_are_one_node():
    a = parse_args(["--port", "1", "--engine", "synthetic"])
    assert (a.nnodes, a.node_rank, a.dist_init_addr) == (1, 0, None)


def test_two_nodes_healthy_only_together_and_node1_dies_with_node0():
    addr = f"{NODE0}:{find_free_port(host=NODE0)}"
    node0 = _node(0, NODE0, addr)
    node1 = None
    try:
        url = _url(node0)
        info = _wait(lambda: httpx.get(f"{url}/get_server_info", timeout=5).json(), 60, "node 0's HTTP server")
        assert (info["nnodes"], info["node_rank"], info["dist_init_addr"]) == (2, 0, addr)
        # alone, node 0 is up but not healthy, and serves no generation
        assert _status(f"{url}/health") == _status(f"{url}/health_generate") == 503
        r = httpx.post(f"{url}/generate", json={"input_ids": [1]}, timeout=5)
        assert r.status_code == 503 and "[1]" in r.json()["error"]["message"]
        http_port = int(url.rsplit(":", 1)[1])
        assert _listening(node0) == {(NODE0, http_port), (NODE0, int(addr.rsplit(":", 1)[1]))}

        node1 = _node(1, NODE1, addr)
        assert node1.stdout.readline().strip() == f"fake_sglang node 1/2 joined {addr}"
        assert node0.stdout.readline().strip() == f"fake_sglang ready {url} engine=synthetic"
        assert _status(f"{url}/health") == _status(f"{url}/health_generate") == 200
        r = httpx.post(
            f"{url}/generate", json={"input_ids": [1], "sampling_params": {"max_new_tokens": 2}}, timeout=30
        )
        assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] >= 1
        assert _listening(node1) == set()  # a node rank >= 1 serves nothing: no HTTP, no rendezvous
        assert all(ip == NODE0 for ip, _ in _listening(node0))  # and node 0 binds only the hosts it was given

        signal_group(node0.pid, signal.SIGKILL)  # node 0 dies without a word: node 1 must notice and exit
        node0.wait(10)
        assert node1.wait(15) == 1
        err = node1.stderr.read()
        assert "node rank 0" in err and "went away; exiting" in err
    finally:
        for p in (node1, node0):
            if p is not None:
                stop_popen(p)


@pytest.mark.slow
def test_node1_waits_for_node0_leaves_on_sigterm_and_node0_turns_unhealthy():
    addr = f"{NODE0}:{find_free_port(host=NODE0)}"
    node1 = _node(1, NODE1, addr)  # before node 0 exists: it retries
    node0 = None
    try:
        time.sleep(1.0)
        assert node1.poll() is None
        node0 = _node(0, NODE0, addr)
        url = _url(node0)
        assert node0.stdout.readline().startswith("fake_sglang ready")
        assert _status(f"{url}/health") == 200
        node1.send_signal(signal.SIGTERM)
        assert node1.wait(15) == 0
        _wait(lambda: _status(f"{url}/health") == 503, 10, "node 0 to see node 1 leave")
        assert node0.poll() is None  # node 0 stays up, unhealthy, and stops cleanly
        node0.send_signal(signal.SIGTERM)
        assert node0.wait(15) == 0
    finally:
        for p in (node1, node0):
            if p is not None:
                stop_popen(p)


@pytest.mark.slow
def test_node1_gives_up_with_a_clear_error_and_a_mismatched_node_is_refused():
    addr = f"{NODE0}:{find_free_port(host=NODE0)}"
    lonely = _node(1, NODE1, addr, "--dist-timeout", "1")
    try:
        assert lonely.wait(20) == 1
        assert f"node rank 0 not reachable at {addr} within 1s" in lonely.stderr.read()
    finally:
        stop_popen(lonely)
    node0 = _node(0, NODE0, addr, "--dist-timeout", "30")
    stranger = None
    try:
        _wait(lambda: _status(f"{_url(node0)}/get_server_info") == 200, 60, "node 0's HTTP server")
        stranger = _node(2, NODE1, addr, nnodes=3)  # thinks the engine has 3 nodes
        assert stranger.wait(20) == 1
        assert "refused to join" in stranger.stderr.read()
        assert _status(f"{_url(node0)}/health") == 503
    finally:
        for p in (stranger, node0):
            if p is not None:
                stop_popen(p)


def test_a_hello_that_waits_too_long_is_asked_again(monkeypatch):
    """Node rank 0 accepts before its model has loaded; while loading, its loop answers nothing. A follower whose
    hello got no answer in HELLO_TIMEOUT_S asks again, and rank 0 counts the rank once, on the newer connection."""
    import asyncio
    import threading

    from sim.fake_sglang import multinode

    monkeypatch.setattr(multinode, "HELLO_TIMEOUT_S", 0.3)
    port = find_free_port()
    rendezvous = multinode.NodeRendezvous("127.0.0.1", port, 2)
    loop = asyncio.new_event_loop()
    ready = threading.Event()

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(rendezvous.start())
        ready.set()
        loop.call_soon(time.sleep, 1.2)  # rank 0 busy (loading its model): the first hello waits past its timeout
        loop.run_forever()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    ready.wait(10)
    result: dict = {}

    async def follower() -> None:
        task = asyncio.create_task(multinode.run_follower(f"127.0.0.1:{port}", 1, 2, timeout_s=10))
        await asyncio.sleep(2.5)  # past the busy spell, the first hello's timeout and the second hello
        result["joined"] = rendezvous.all_joined.is_set()  # still joined: not only for the moment of a hello
        result["peers"] = list(rendezvous._peers)
        result["follower_alive"] = not task.done()  # it holds its connection, as a joined node rank does
        task.cancel()

    try:
        asyncio.run(follower())
    finally:
        asyncio.run_coroutine_threadsafe(rendezvous.close(), loop).result(10)  # no connection handler left pending
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()
    assert not rendezvous._handlers
    assert result["joined"] and result["peers"] == [1] and result["follower_alive"], result
