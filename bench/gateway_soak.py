"""Gateway soak: two `slime gateway` processes on one persistent `redis-server`, many sessions of many turns at a
fixed concurrency, the scripted fake engine behind, and faults mid-run: one gateway SIGKILLed (then started
again on its port) and Redis restarted. Clients are httpx with the retries agent clients make (fail over to
the other gateway on a connection error, back off on 408/429/5xx).

    .venv/bin/python -m bench.gateway_soak [--sessions 1000] [--turns 10] [--concurrency 64] \
        [--no-faults] [--out bench/results/gateway_soak.json]

What it checks, per finished session: one segment of exactly `turns` sampled spans, each an engine call's
output right after that call's prompt (exact tokens: nothing lost, nothing duplicated by a retry); and that
clients saw only retryable errors. What it measures: turn latency at the client, the engine's share of it
(the gateway's `X-Slime-Engine-Ms`), and so the gateway's added latency, on turns that needed no retry.
Prints a table and writes JSON; never asserts (`tests/integration/test_agent_gateway_soak.py` runs a small one
and asserts on the checks, never on time).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bench.gateway_stack import (
    GatewayProcess,
    RedisServer,
    RetryingClient,
    engine_calls,
    percentile,
    start_engine,
    trajectory_problem,
)
from bench.run_cpu import write_result
from slime.agent.api import ENGINE_MS_HEADER

logger = logging.getLogger(__name__)


class Soak:
    def __init__(self, urls: list[str], sessions: int, turns: int) -> None:
        self.urls, self.sessions, self.turns, self.total = urls, sessions, turns, sessions * turns
        self.done_turns = 0
        self.clean: list[tuple[float, float]] = []  # (client ms, engine ms) of turns answered at the first try
        self.retried_ms: list[float] = []
        self.results: list[dict[str, Any]] = []
        self.failed: list[str] = []

    async def session(self, c: RetryingClient, i: int) -> None:
        try:
            r, _ = await c.post("/admin/sessions", i, {"metadata": {"i": i}})
            sess = r.json()
            messages: list[dict[str, Any]] = [{"role": "system", "content": f"Session S{i}."}]
            for t in range(self.turns):
                text = f"LAST of S{i}" if t == self.turns - 1 else f"T{t} of S{i}"
                messages.append({"role": "user", "content": text})
                t0 = time.perf_counter()
                body = {"model": "m", "messages": messages}
                r, tries = await c.post("/v1/chat/completions", i + t, body, key=sess["api_key"])
                ms = (time.perf_counter() - t0) * 1e3
                if tries == 1:
                    self.clean.append((ms, float(r.headers[ENGINE_MS_HEADER])))
                else:
                    self.retried_ms.append(ms)
                messages.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
                self.done_turns += 1
            r, _ = await c.post(f"/admin/sessions/{sess['session_id']}/finish", i + self.turns + 1)
            self.results.append({"i": i, "session_id": sess["session_id"], "samples": r.json()["samples"]})
        except Exception as e:  # counted as lost: the checks below report it
            self.failed.append(f"S{i}: {type(e).__name__}: {e}")


def _when(soak: Soak, fraction: float) -> None:
    while soak.done_turns < fraction * soak.total and len(soak.results) + len(soak.failed) < soak.sessions:
        time.sleep(0.05)


def kill_gateway(soak: Soak, gateway: GatewayProcess, log: list[dict[str, Any]], done: threading.Event) -> None:
    """In a thread: SIGKILL one gateway at 25% of the turns, start it again on its port 2 s later. The thread
    lives until `done`: what it starts dies with the thread that started it (PR_SET_PDEATHSIG)."""
    _when(soak, 0.25)
    at, t0 = soak.done_turns, time.monotonic()
    gateway.kill()
    time.sleep(2.0)
    gateway.start()
    log.append({"fault": "gateway SIGKILL, started again", "at_turn": at, "down_s": round(time.monotonic() - t0, 1)})
    done.wait()


def restart_redis(soak: Soak, redis: RedisServer, log: list[dict[str, Any]], done: threading.Event) -> None:
    """In a thread: restart redis-server (SIGTERM: it writes its append-only file out) at 50% of the turns."""
    _when(soak, 0.50)
    at, t0 = soak.done_turns, time.monotonic()
    redis.restart(down_s=1.0)
    log.append(
        {"fault": "redis-server restart (SIGTERM, AOF)", "at_turn": at, "down_s": round(time.monotonic() - t0, 1)}
    )
    done.wait()


def run_soak(
    sessions: int, turns: int, concurrency: int, faults: bool, work: Path, ckpt: Path | None = None
) -> dict[str, Any]:
    """Run one soak in `work`; returns the checks and the latencies."""
    from sim.tiny_checkpoint import build_tiny_checkpoint

    ckpt = ckpt or build_tiny_checkpoint(work / "tiny")
    redis = RedisServer(work / "redis")
    redis.start()
    engine, engine_url, engine_log = start_engine(ckpt, work)
    gateways = [GatewayProcess(engine_url, ckpt, redis.url, work / f"gateway{k}.log") for k in range(2)]
    fault_log: list[dict[str, Any]] = []
    try:
        for g in gateways:
            g.start()
        soak = Soak([g.url for g in gateways], sessions, turns)
        done = threading.Event()
        injectors = [
            threading.Thread(target=kill_gateway, args=(soak, gateways[0], fault_log, done), daemon=True),
            threading.Thread(target=restart_redis, args=(soak, redis, fault_log, done), daemon=True),
        ]

        async def main() -> RetryingClient:
            limits = httpx.Limits(max_connections=2 * concurrency)
            async with httpx.AsyncClient(timeout=120, limits=limits) as http:
                client = RetryingClient(http, soak.urls)
                gate = asyncio.Semaphore(concurrency)

                async def one(i: int) -> None:
                    async with gate:
                        await soak.session(client, i)

                await asyncio.gather(*(one(i) for i in range(sessions)))
                return client

        t0 = time.monotonic()
        for t in injectors if faults else []:
            t.start()
        client = asyncio.run(main())
        elapsed = time.monotonic() - t0
    finally:
        for g in gateways:
            g.stop()
        engine.stop()
        redis.stop()
        done.set()
    calls = engine_calls(engine_log)
    problems = {
        r["session_id"]: trajectory_problem(r["samples"], calls.get(r["session_id"], []), turns) for r in soak.results
    }
    bad = {sid: p for sid, p in problems.items() if p}
    added = [ms - eng for ms, eng in soak.clean]
    return {
        "sessions": sessions,
        "turns_per_session": turns,
        "concurrency": concurrency,
        "faults": fault_log,
        "elapsed_s": round(elapsed, 1),
        "turns_per_s": round(soak.done_turns / elapsed, 1),
        "finished_exact": len(soak.results) - len(bad),
        "inexact_or_duplicated": bad,
        "lost": soak.failed,
        "errors_seen": dict(client.errors),
        "non_retryable_errors": sum(n for k, n in client.errors.items() if k.startswith("NOT")),
        "engine_calls": sum(len(v) for v in calls.values()),
        "clean_turns": len(soak.clean),
        "retried_turns": len(soak.retried_ms),
        "latency_ms": {
            "client_p50": percentile([m for m, _ in soak.clean], 50),
            "client_p99": percentile([m for m, _ in soak.clean], 99),
            "engine_p50": percentile([e for _, e in soak.clean], 50),
            "engine_p99": percentile([e for _, e in soak.clean], 99),
            "gateway_added_p50": percentile(added, 50),
            "gateway_added_p99": percentile(added, 99),
            "retried_turn_p50": percentile(soak.retried_ms, 50),
            "retried_turn_max": max(soak.retried_ms, default=float("nan")),
        },
    }


def report(r: dict[str, Any]) -> str:
    lat = r["latency_ms"]
    lines = [
        f"{r['sessions']} sessions x {r['turns_per_session']} turns at {r['concurrency']} concurrent: "
        f"{r['elapsed_s']} s, {r['turns_per_s']} turns/s, {r['engine_calls']} engine calls",
        f"faults: {[f['fault'] + ' at turn ' + str(f['at_turn']) for f in r['faults']] or 'none'}",
        f"finished exact: {r['finished_exact']} / {r['sessions']}; inexact or duplicated: {len(r['inexact_or_duplicated'])};"
        f" lost: {len(r['lost'])}; non-retryable errors: {r['non_retryable_errors']}",
        f"errors clients saw (all retried): {r['errors_seen']}",
        "| turns answered at the first try | p50 ms | p99 ms |",
        "|---|---|---|",
        f"| at the client | {lat['client_p50']:.1f} | {lat['client_p99']:.1f} |",
        f"| the engine's share | {lat['engine_p50']:.1f} | {lat['engine_p99']:.1f} |",
        f"| gateway added | {lat['gateway_added_p50']:.1f} | {lat['gateway_added_p99']:.1f} |",
        f"retried turns: {r['retried_turns']} (p50 {lat['retried_turn_p50']:.0f} ms, max {lat['retried_turn_max']:.0f} ms)",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=1000)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--no-faults", action="store_true", help="no gateway kill, no Redis restart")
    ap.add_argument("--out", default="bench/results/gateway_soak.json")
    ap.add_argument("--work", default=None, help="keep the processes' logs here (default: a temporary directory)")
    a = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="gateway-soak-") as d:
        r = run_soak(a.sessions, a.turns, a.concurrency, not a.no_faults, Path(a.work or d))
    write_result(a.out, r)
    print(report(r))


if __name__ == "__main__":
    main()
