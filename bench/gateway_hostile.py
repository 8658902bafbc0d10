"""One hostile client beside well-behaved sessions: does the well-behaved p99 stay within 2x of its unloaded value?

    .venv/bin/python -m bench.gateway_hostile [--sessions 32] [--turns 50] [--think-ms 100] [--hostile-priority idle] \
        [--out bench/results/gateway_hostile.json]

One `slime gateway` process (memory store) in front of the scripted fake engine (tiny checkpoint, context 4096
tokens). Phase 1: `--sessions` well-behaved sessions, each a closed loop of chat turns with `--think-ms` between
them (an agent runs its tools), episodes of 10 turns. Phase 2: the same while a hostile client, in its own
process, repeats the held-out probe's requests: a 50 MB chat body, 20k tool definitions (~8 MB, the 1.85M-token
prompt), a prompt a little over the context, and 24 bodies at once on one session whose Content-Length is
never sent (more than a session's share of requests in flight: 429 beyond it, 408 for the rest). Reports p50/p99 of the well-behaved turns at the client and the gateway's
added latency over the engine's (`X-Slime-Engine-Ms`), the hostile answers by status, and the p99 ratio (the
target is <= 2), and a `/health` every 20 ms (the gateway loop's own lag). The hostile process shares the two
cores; by default it is idle-class, its CPU standing in for another machine's. Never asserts (the numbers
belong to the machine).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import multiprocessing
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from bench.gateway_stack import ADMIN, GatewayProcess, percentile, start_engine
from bench.run_cpu import write_result
from slime.agent.api import ENGINE_MS_HEADER
from slime.agent.prepare_pool import lowest_priority

logger = logging.getLogger(__name__)

EPISODE_TURNS = 10


async def well_behaved(
    url: str, sessions: int, turns: int, think_s: float, health: list[float] | None = None
) -> list[tuple[float, float]]:
    """(client ms, engine ms) of every turn of `sessions` closed-loop sessions; meanwhile, with `health`, the
    latency of a `/health` every 20 ms (how long the gateway's loop takes to answer anything)."""
    out: list[tuple[float, float]] = []
    running = True
    admin = {"Authorization": f"Bearer {ADMIN}"}
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=4 * sessions)) as c:

        async def one(i: int) -> None:
            for e in range(turns // EPISODE_TURNS):
                key = (await c.post("/admin/sessions", json={}, headers=admin)).json()["api_key"]
                msgs: list[dict[str, Any]] = [{"role": "system", "content": f"Session {i}.{e}."}]
                for t in range(EPISODE_TURNS):
                    msgs.append({"role": "user", "content": f"T{t} of S{i}"})
                    t0 = time.perf_counter()
                    r = await c.post("/v1/chat/completions", json={"model": "m", "messages": msgs},
                                     headers={"Authorization": f"Bearer {key}"})  # fmt: skip
                    ms = (time.perf_counter() - t0) * 1e3
                    r.raise_for_status()
                    out.append((ms, float(r.headers[ENGINE_MS_HEADER])))
                    msgs.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
                    await asyncio.sleep(think_s)

        async def ping() -> None:
            while running and health is not None:
                t0 = time.perf_counter()
                (await c.get("/health")).raise_for_status()
                health.append((time.perf_counter() - t0) * 1e3)
                await asyncio.sleep(0.02)

        pinger = asyncio.ensure_future(ping())
        await asyncio.gather(*(one(i) for i in range(sessions)))
        running = False
        await pinger
    return out


# ---- the hostile client (its own process) ------------------------------------------------------------------


def _bodies() -> dict[str, bytes]:
    params = {"type": "object", "properties": {f"p{j}": {"type": "string", "description": "x"} for j in range(5)}}
    tools = [{"type": "function", "function": {"name": f"t{i}", "description": "d" * 50, "parameters": params}}
             for i in range(20_000)]  # fmt: skip
    chat = lambda text, **kw: json.dumps({"model": "m", "messages": [{"role": "user", "content": text}], **kw})  # noqa: E731
    return {
        "50mb:50 MB chat body": chat("x " * (25 << 20)).encode(),
        "tools:20k tool definitions": chat("hi", tools=tools).encode(),
        "over:prompt just over the context": chat("word " * 6000).encode(),
    }


async def _slow_body(host: str, port: int, key: str, stats: Counter) -> None:
    r, w = await asyncio.open_connection(host, port)
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n"
            "Content-Type: application/json\r\nContent-Length: 1000000\r\n\r\n{\"messages\": [")  # fmt: skip
    w.write(head.encode())
    await w.drain()
    line = await r.readline()  # the gateway's answer: 408 after its body timeout, or 429 at once
    stats[
        f"24 bodies at once whose Content-Length is never sent: {line.decode().split(' ', 2)[1] if line else 'closed'}"
    ] += 1
    w.close()


KINDS = ("50mb", "tools", "over", "slow")


async def _hostile(url: str, keys: list[str], stop_at: float, stats: Counter, kinds: list[str]) -> None:
    bodies = {k: v for k, v in _bodies().items() if k.split(":")[0] in kinds}
    host, port = url.removeprefix("http://").split(":")
    async with httpx.AsyncClient(base_url=url, timeout=300) as c:

        async def big() -> None:
            while bodies and time.monotonic() < stop_at:
                for kind, body in bodies.items():
                    h = {"Authorization": f"Bearer {keys[0]}", "Content-Type": "application/json"}
                    r = await c.post("/v1/chat/completions", content=body, headers=h)
                    stats[f"{kind.split(':', 1)[1]}: {r.status_code}"] += 1

        async def slow() -> None:  # more than the session's share: 16 held until their 408, the rest 429
            while "slow" in kinds and time.monotonic() < stop_at:
                await asyncio.gather(*(_slow_body(host, int(port), keys[1], stats) for _ in range(24)))

        await asyncio.gather(big(), slow())


def hostile_main(url: str, keys: list[str], seconds: float, priority: str, kinds: list[str], out: Any) -> None:
    if priority == "idle":  # its CPU stands in for another machine's: it takes only what nothing here wants
        lowest_priority()
    stats: Counter = Counter()
    asyncio.run(_hostile(url, keys, time.monotonic() + seconds, stats, kinds))
    out.put(dict(stats))


# ---- the run -------------------------------------------------------------------------------------------------


def stats(rows: list[tuple[float, float]], health: list[float]) -> dict[str, float]:
    client, added = [m for m, _ in rows], [m - e for m, e in rows]
    return {
        "health_p50_ms": percentile(health, 50),
        "health_p99_ms": percentile(health, 99),
        "turns": len(rows),
        "client_p50_ms": percentile(client, 50),
        "client_p99_ms": percentile(client, 99),
        "engine_p50_ms": percentile([e for _, e in rows], 50),
        "gateway_added_p50_ms": percentile(added, 50),
        "gateway_added_p99_ms": percentile(added, 99),
    }


def run_bench(
    sessions: int, turns: int, think_s: float, priority: str, kinds: list[str], work: Path
) -> dict[str, Any]:
    from sim.tiny_checkpoint import build_tiny_checkpoint

    ckpt = build_tiny_checkpoint(work / "tiny")
    engine, engine_url, _ = start_engine(ckpt, work)
    gw = GatewayProcess(engine_url, ckpt, "memory", work / "gateway.log")
    try:
        gw.start()
        asyncio.run(well_behaved(gw.url, 4, EPISODE_TURNS, 0.0))  # warm-up
        health_unloaded: list[float] = []
        unloaded = asyncio.run(well_behaved(gw.url, sessions, turns, think_s, health_unloaded))
        t0 = time.monotonic()
        asyncio.run(well_behaved(gw.url, sessions, EPISODE_TURNS, think_s))
        phase_s = (time.monotonic() - t0) * turns / EPISODE_TURNS
        admin = {"Authorization": f"Bearer {ADMIN}"}
        keys = [httpx.post(f"{gw.url}/admin/sessions", json={}, headers=admin).json()["api_key"] for _ in range(3)]
        ctx = multiprocessing.get_context("spawn")
        box = ctx.Queue()
        hostile = ctx.Process(
            target=hostile_main, args=(gw.url, keys, phase_s + 30, priority, kinds, box), daemon=True
        )
        hostile.start()
        time.sleep(15)  # the hostile client builds its bodies and reaches its stride (prepare workers started)
        health_loaded: list[float] = []
        loaded = asyncio.run(well_behaved(gw.url, sessions, turns, think_s, health_loaded))
        hostile_answers = box.get(timeout=600)
        hostile.join(60)
        health = httpx.get(f"{gw.url}/health", timeout=10).status_code
    finally:
        gw.stop()
        engine.stop()
    a, b = stats(unloaded, health_unloaded), stats(loaded, health_loaded)
    return {
        "sessions": sessions,
        "turns_per_session": turns,
        "think_ms": think_s * 1e3,
        "hostile_priority": priority,
        "hostile_kinds": kinds,
        "unloaded": a,
        "with_hostile_client": b,
        "p99_ratio": b["client_p99_ms"] / a["client_p99_ms"],
        "hostile_answers": hostile_answers,
        "health_after": health,
    }


def report(r: dict[str, Any]) -> str:
    a, b = r["unloaded"], r["with_hostile_client"]
    lines = [
        f"{r['sessions']} well-behaved sessions x {r['turns_per_session']} turns, {r['think_ms']:.0f} ms think time",
        "| | turns | client p50 ms | client p99 ms | gateway added p50 ms | gateway added p99 ms "
        "| /health p50 ms | /health p99 ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, s in (("unloaded", a), ("with the hostile client", b)):
        lines.append(
            f"| {name} | {s['turns']} | {s['client_p50_ms']:.1f} | {s['client_p99_ms']:.1f} | "
            f"{s['gateway_added_p50_ms']:.1f} | {s['gateway_added_p99_ms']:.1f} | {s['health_p50_ms']:.1f} | "
            f"{s['health_p99_ms']:.1f} |"
        )
    lines.append(f"p99 with / without: {r['p99_ratio']:.2f} (target <= 2)")
    lines += [f"  hostile {k}: {n}" for k, n in sorted(r["hostile_answers"].items())]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=32)
    ap.add_argument("--turns", type=int, default=50, help="turns per session (episodes of 10)")
    ap.add_argument("--think-ms", type=float, default=100.0, help="pause between a session's turns")
    ap.add_argument(
        "--hostile-priority",
        choices=("idle", "normal"),
        default="idle",
        help="scheduling of the hostile client's process: idle (its CPU stands in for another machine's) or normal",
    )
    ap.add_argument(
        "--hostile", default=",".join(KINDS), help=f"what the hostile client sends, a comma list of {', '.join(KINDS)}"
    )
    ap.add_argument("--out", default="bench/results/gateway_hostile.json")
    a = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="gateway-hostile-") as d:
        r = run_bench(a.sessions, a.turns, a.think_ms / 1e3, a.hostile_priority, a.hostile.split(","), Path(d))
    write_result(a.out, r)
    print(report(r))


if __name__ == "__main__":
    main()
