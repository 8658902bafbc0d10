"""In-process stand-in for sglang-router 0.3.2's HTTP surface, for property tests only.

Why: property tests register / remove workers and send thousands of requests; the real router costs ~3 s and
~300 MiB to start. Shapes were taken from the real 0.3.2 binary on loopback (`POST /workers` answers 202
`{"status": "accepted", "worker_id", "url", "location", "message"}`; `GET /workers` answers
`{"workers": [...], "total", "stats": {prefill_count, decode_count, regular_count}}`; `DELETE /workers/{id}`
202; a non-UUID id 400; `/generate` with no worker 503 `{"error": {"type", "code": "no_available_workers",
"message"}}`; `/health` 200 "OK"). Malformed bodies get the real router's 415 / 400 / 422 plain-text answers
(router_body.py). Integration tests use the real router: only it shows what the real one does.

Policies: round_robin, random, and manual — sticky per `X-SMG-Routing-Key` header (0.3.2's `manual`
policy); here by consistent hashing over a ring of virtual nodes, so removing a worker only moves its keys.

CLI: ``python -m sim.fake_sglang.mock_router --host 127.0.0.1 --port P --worker-urls URL ... --policy P``.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import hashlib
import random
import signal
import uuid
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from sim.fake_sglang.router_body import GENERATE_REQUEST, WORKER_CONFIG, Rejected, decode_json, uuid_error

ROUTING_KEY_HEADER = "X-SMG-Routing-Key"
POLICIES = ("round_robin", "random", "manual")
_VNODES = 64


def worker_id_for(url: str) -> str:
    # The real router returns the same id when a URL is registered twice; a name-based UUID gives that.
    return str(uuid.uuid5(uuid.NAMESPACE_URL, url))


def _h(s: str) -> int:
    return int.from_bytes(hashlib.sha256(s.encode()).digest()[:8], "big")


@dataclass
class Worker:
    url: str
    worker_type: str = "regular"
    bootstrap_port: int | None = None

    @property
    def id(self) -> str:
        return worker_id_for(self.url)

    def to_json(self, load: int) -> dict[str, Any]:
        d = {
            "id": self.id,
            "url": self.url,
            "model_id": "unknown",
            "priority": 50,
            "cost": 1.0,
            "worker_type": self.worker_type,
            "is_healthy": True,
            "load": load,
            "connection_mode": "HTTP",
            "disable_health_check": False,
        }
        if self.bootstrap_port is not None:
            d["bootstrap_port"] = self.bootstrap_port
        return d


class Router:
    """Worker registry + selection policy; pure (no I/O), so property tests can drive it directly."""

    def __init__(self, policy: str = "round_robin", seed: int = 0) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}")
        self.policy = policy
        self.workers: dict[str, Worker] = {}
        self.load: dict[str, int] = {}
        self._rr = 0
        self._rng = random.Random(seed)
        self._ring: list[tuple[int, str]] = []

    def add(self, url: str, worker_type: str = "regular", bootstrap_port: int | None = None) -> Worker:
        w = Worker(url.rstrip("/"), worker_type, bootstrap_port)
        if w.id not in self.workers:
            self.workers[w.id] = w
            self.load[w.id] = 0
            self._rebuild_ring()
        return self.workers[w.id]

    def remove(self, worker_id: str) -> bool:
        if self.workers.pop(worker_id, None) is None:
            return False
        self.load.pop(worker_id, None)
        self._rebuild_ring()
        return True

    def _rebuild_ring(self) -> None:
        self._ring = sorted((_h(f"{wid}#{v}"), wid) for wid in self.workers for v in range(_VNODES))

    def select(self, routing_key: str | None = None) -> Worker | None:
        ids = sorted(wid for wid, w in self.workers.items() if w.worker_type == "regular")
        if not ids:
            return None
        if self.policy == "manual" and routing_key is not None:
            ring = [(h, wid) for h, wid in self._ring if wid in ids]
            i = bisect.bisect_left(ring, (_h(routing_key), ""))
            return self.workers[ring[i % len(ring)][1]]
        if self.policy == "random" or self.policy == "manual":
            return self.workers[self._rng.choice(ids)]
        w = self.workers[ids[self._rr % len(ids)]]
        self._rr += 1
        return w

    def list_json(self) -> dict[str, Any]:
        ws = [w.to_json(self.load.get(w.id, 0)) for w in self.workers.values()]
        count = {t: sum(1 for w in self.workers.values() if w.worker_type == t) for t in ("prefill", "decode")}
        regular = sum(1 for w in self.workers.values() if w.worker_type == "regular")
        return {
            "workers": ws,
            "total": len(ws),
            "stats": {"prefill_count": count["prefill"], "decode_count": count["decode"], "regular_count": regular},
        }


def build_router_app(router: Router) -> web.Application:
    """The router's HTTP surface over `router`; /generate is proxied to the selected worker as it came."""
    session: dict[str, aiohttp.ClientSession] = {}

    def bad_id(wid: str) -> web.Response | None:
        err = uuid_error(wid)
        if err is None:
            return None
        msg = f"Invalid worker_id '{wid}' (expected UUID). Error: {err}"
        return web.json_response({"error": msg, "code": "BAD_REQUEST"}, status=400)

    def not_found(wid: str) -> web.Response:
        return web.json_response({"error": f"Worker {wid} not found", "code": "WORKER_NOT_FOUND"}, status=404)

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="OK")

    async def list_workers(request: web.Request) -> web.Response:
        return web.json_response(router.list_json())

    async def get_worker(request: web.Request) -> web.Response:
        wid = request.match_info["wid"]
        w = router.workers.get(wid)
        if w is None:
            return bad_id(wid) or not_found(wid)
        return web.json_response(w.to_json(router.load.get(w.id, 0)))

    async def add_worker(request: web.Request) -> web.Response:
        try:
            body = decode_json(await request.read(), request.headers.get("Content-Type"), WORKER_CONFIG)
        except Rejected as e:
            return e.response
        w = router.add(body["url"], body.get("worker_type") or "regular", body.get("bootstrap_port"))
        return web.json_response(
            {
                "status": "accepted",
                "worker_id": w.id,
                "url": w.url,
                "location": f"/workers/{w.id}",
                "message": "Worker addition queued for background processing",
            },
            status=202,
        )

    async def delete_worker(request: web.Request) -> web.Response:
        wid = request.match_info["wid"]
        invalid = bad_id(wid)
        if invalid is not None:
            return invalid
        if not router.remove(wid):
            return not_found(wid)
        return web.json_response(
            {"status": "accepted", "worker_id": wid, "message": "Worker removal queued for background processing"},
            status=202,
        )

    async def proxy(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        try:
            decode_json(body, request.headers.get("Content-Type"), GENERATE_REQUEST)  # before a worker is picked
        except Rejected as e:
            return e.response
        w = router.select(request.headers.get(ROUTING_KEY_HEADER))
        if w is None:
            err = {
                "type": "Service Unavailable",
                "code": "no_available_workers",
                "message": "No available workers (all circuits open or unhealthy)",
            }
            return web.json_response({"error": err}, status=503)
        if "s" not in session:
            session["s"] = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        headers = {
            k: v for k, v in request.headers.items() if k.lower() in ("content-type", ROUTING_KEY_HEADER.lower())
        }
        router.load[w.id] = router.load.get(w.id, 0) + 1
        try:
            async with session["s"].request(request.method, w.url + request.path, data=body, headers=headers) as up:
                resp = web.StreamResponse(status=up.status, headers={"Content-Type": up.content_type})
                resp.headers["X-Mock-Router-Worker"] = w.url
                await resp.prepare(request)
                async for chunk in up.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
                return resp
        finally:
            if w.id in router.load:
                router.load[w.id] -= 1

    async def close(_app: web.Application) -> None:
        if "s" in session:
            await session["s"].close()

    @web.middleware
    async def bare_route_errors(request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            return await handler(request)
        except (web.HTTPNotFound, web.HTTPMethodNotAllowed) as e:
            return web.Response(status=e.status)  # axum: an unknown route or method gets an empty body

    app = web.Application(client_max_size=1 << 30, middlewares=[bare_route_errors])
    app.router.add_get("/health", health)
    app.router.add_get("/workers", list_workers)
    app.router.add_post("/workers", add_worker)
    app.router.add_get("/workers/{wid:[^/]+}", get_worker)  # any segment: a non-UUID id is a 400, not a 404
    app.router.add_delete("/workers/{wid:[^/]+}", delete_worker)
    app.router.add_post("/generate", proxy)
    app.on_cleanup.append(close)
    return app


async def _serve(a: argparse.Namespace) -> None:
    router = Router(a.policy, seed=a.random_seed)
    for url in a.worker_urls:
        router.add(url)
    runner = web.AppRunner(build_router_app(router), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, a.host, a.port).start()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    print(f"mock_router ready http://{a.host}:{a.port} policy={a.policy}", flush=True)
    await stop.wait()
    await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m sim.fake_sglang.mock_router")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--worker-urls", nargs="*", default=[])
    p.add_argument("--policy", choices=POLICIES, default="round_robin")
    p.add_argument("--random-seed", type=int, default=0)
    asyncio.run(_serve(p.parse_args(argv)))


if __name__ == "__main__":
    main()
