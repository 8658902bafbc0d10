"""The real sglang-router 0.3.2 in front of two tiny aiohttp backends that say which of them served.

Routers start once per module (one round-robin, one with slime's `consistent_hashing`); ~3 s each.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import logging
import threading
from collections import Counter
from typing import Any

import httpx
import psutil
import pytest
from aiohttp import web

from slime.arguments import default_args
from slime.backends.sglang.router import RouterProcess, build_router_argv
from slime.utils.http_utils import find_free_port

pytestmark = pytest.mark.cpu

ROUTING_KEY = "X-SMG-Routing-Key"


class Backends:
    """N minimal SGLang-shaped servers (`/health`, `/generate`) on loopback, on one background event loop."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.ports = [find_free_port() for _ in names]
        self.loop = asyncio.new_event_loop()
        self.runners: list[web.AppRunner] = []
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.ports]

    async def _start(self) -> None:
        for name, port in zip(self.names, self.ports, strict=True):
            app = web.Application()

            async def health(_req: web.Request) -> web.Response:
                return web.json_response({})

            async def generate(req: web.Request, name: str = name) -> web.Response:
                body = await req.json()
                meta = {"served_by": name, "routing_key": req.headers.get(ROUTING_KEY), "finish_reason": None}
                return web.json_response({"text": "", "output_ids": body.get("input_ids", []), "meta_info": meta})

            app.router.add_get("/health", health)
            app.router.add_post("/generate", generate)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            self.runners.append(runner)

    async def _stop(self) -> None:
        for r in self.runners:
            await r.cleanup()

    def start(self) -> None:
        # The router probes new workers for gRPC too (HTTP/2 preface); aiohttp logs those as bad requests.
        logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(timeout=30)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


def router_args(**kw: Any) -> argparse.Namespace:
    """Module-scoped routers use these too, so the parser's defaults come from `default_args`, not the fixture."""
    return default_args(sglang_router_request_timeout_secs=600, **kw)


@pytest.fixture(scope="module")
def backends():
    b = Backends(["A", "B"])
    b.start()
    try:
        yield b
    finally:
        b.stop()


def _start_router(tmp_path_factory, args, backends: Backends):
    log = tmp_path_factory.mktemp("router") / "router.log"
    router = RouterProcess.start(args, host="127.0.0.1", port=find_free_port(), log_file=str(log))
    try:
        for url in backends.urls:
            router.add_worker(url)
    except BaseException:
        router.stop()
        raise
    return router


@pytest.fixture(scope="module")
def rr_router(tmp_path_factory, backends):
    router = _start_router(tmp_path_factory, router_args(router_policy="round_robin"), backends)
    try:
        yield router
    finally:
        router.stop()


@pytest.fixture(scope="module")
def affinity_router(tmp_path_factory, backends):
    router = _start_router(tmp_path_factory, router_args(router_policy="consistent_hashing"), backends)
    try:
        yield router
    finally:
        router.stop()


def _served_by(router: RouterProcess, key: str | None = None) -> str:
    headers = {ROUTING_KEY: key} if key is not None else {}
    r = httpx.post(f"{router.url}/generate", json={"input_ids": [1, 2, 3]}, headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["meta_info"]["served_by"]


def test_it_is_the_real_router(rr_router):
    assert importlib.metadata.version("sglang-router") == "0.3.2"
    proc = psutil.Process(rr_router.pid)
    # launch_router renames its process title to "sglang::router" (setproctitle), so check the command we
    # started and that the router's Rust extension is what the process has loaded.
    assert any("sglang_router" in part for part in rr_router.process.proc.args)
    assert "sglang" in " ".join(proc.cmdline())
    assert any("sglang_router_rs" in m.path for m in proc.memory_maps())


def test_only_loopback_listeners(rr_router):
    """The router and its Prometheus exporter bind 127.0.0.1 only (0.3.2's defaults would be 0.0.0.0)."""
    conns = [c for c in psutil.net_connections(kind="inet") if c.pid == rr_router.pid and c.status == "LISTEN"]
    assert {c.laddr.port for c in conns} >= {rr_router.port}
    assert len(conns) == 2, conns  # API + Prometheus
    assert all(c.laddr.ip == "127.0.0.1" for c in conns), conns


def test_round_robin_alternates(rr_router):
    served = [_served_by(rr_router) for _ in range(8)]
    assert set(served) == {"A", "B"}
    assert all(a != b for a, b in zip(served, served[1:], strict=False)), served


def test_consistent_hashing_pins_each_routing_key(affinity_router):
    keys = [f"session-{i}" for i in range(24)]
    first = {k: _served_by(affinity_router, k) for k in keys}
    for _ in range(3):
        for k in keys:
            assert _served_by(affinity_router, k) == first[k], k
    # Different sessions spread over both workers (assignment is random per new key: 2 * 0.5**24 to fail).
    assert set(Counter(first.values())) == {"A", "B"}


def test_add_and_remove_worker(rr_router, backends):
    a_url, b_url = backends.urls
    assert {w["url"] for w in rr_router.list_workers()} == {a_url, b_url}
    try:
        assert rr_router.remove_worker(b_url) is True
        assert [w["url"] for w in rr_router.list_workers()] == [a_url]
        assert {_served_by(rr_router) for _ in range(4)} == {"A"}
        assert rr_router.remove_worker(b_url) is False
    finally:
        if b_url not in {w["url"] for w in rr_router.list_workers()}:
            rr_router.add_worker(b_url)
    workers = rr_router.list_workers()
    assert {w["url"] for w in workers} == {a_url, b_url}
    assert all(w["is_healthy"] for w in workers)
    assert {_served_by(rr_router) for _ in range(4)} == {"A", "B"}


def test_start_failure_reports_log_tail(tmp_path):
    # An invalid pass-through value makes launch_router exit at once; the error must carry its log.
    args = router_args(router_policy="round_robin", router_retry_jitter_factor=7.0)
    with pytest.raises(RuntimeError, match="exited with code") as e:
        RouterProcess.start(args, host="127.0.0.1", port=find_free_port(), log_file=str(tmp_path / "r.log"))
    # the tail of its log, naming the file and the router's own complaint
    assert str(tmp_path / "r.log") in str(e.value) and "jitter_factor" in str(e.value)


def test_build_router_argv_forces_slime_settings():
    args = router_args(router_policy="consistent_hashing", router_log_level="warn", router_prometheus_port=29123)
    argv = build_router_argv(args, host="127.0.0.1", port=30000, pd=True)
    assert argv[1:3] == ["-m", "sglang_router.launch_router"]
    joined = " ".join(argv)
    assert "--host 127.0.0.1 --port 30000" in joined
    assert "--policy manual" in joined and "consistent_hashing" not in joined
    assert "--request-timeout-secs 600" in joined
    assert "--prometheus-host 127.0.0.1 " in joined and "--prometheus-port 29123" in joined
    for flag in ("--disable-health-check", "--pd-disaggregation", "--disable-circuit-breaker"):
        assert flag in argv
    assert "--log-level warn" in joined
