"""Episode throughput of the coding-agent example: how many repository-task episodes per minute this machine
runs, and where an episode's time goes (sandbox boot, the agent CLI, scoring in a fresh sandbox).

    .venv/bin/python -m bench.coding_agent_throughput [--harness claude-code] [--episodes 24] [--concurrency 1 2 4]

Each episode is the example's generate function (slime/agent/harness/repo_task.py) with the real CLI in a
`local` sandbox against the in-process gateway and a `scripted` fake engine replaying the example's scripted
policy (examples/coding_agent/scripted_policy.py), over the 12 tasks in turn. No training, no Ray: this is
the rollout side only. Prints a table (episodes/min, mean seconds per phase, ratio to concurrency 1) and
writes JSON. A bench, not a test: it checks only that every reward is the known one.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "examples" / "coding_agent" / "tasks.jsonl"


async def run_batch(args: Any, rows: list[dict[str, Any]], n: int, concurrency: int) -> list[dict[str, Any]]:
    from examples.coding_agent.scripted_policy import expected_reward
    from slime.agent.harness import repo_task
    from slime.utils.types import Sample

    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> dict[str, Any]:
        row = rows[i % len(rows)]
        async with sem:
            (s, *_) = await repo_task.generate(
                args, Sample(index=i, prompt=row["input"], metadata=dict(row["metadata"])), {}
            )
        m = s.metadata
        ok = m.get("reward") == expected_reward(m["instance_id"])
        return {k: m.get(k) for k in ("boot_seconds", "agent_seconds", "score_seconds", "elapsed_seconds")} | {
            "ok": ok
        }

    return list(await asyncio.gather(*(one(i) for i in range(n))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--harness", choices=("claude-code", "codex"), default="claude-code")
    ap.add_argument("--episodes", type=int, default=24)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--out-json", default=str(ROOT / "bench" / "results" / "coding_agent_throughput.json"))
    a = ap.parse_args()

    from examples.coding_agent.scripted_policy import build_script
    from sim.fake_sglang.testing import launch_fake_sglang
    from sim.tiny_checkpoint import build_tiny_checkpoint
    from slime.agent.embedded import stop_embedded_gateway
    from slime.arguments import default_args

    rows = [json.loads(line) for line in TASKS.read_text().splitlines()]
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-coding-") as d:
        ckpt = build_tiny_checkpoint(Path(d) / "tiny")
        (Path(d) / "script.json").write_text(json.dumps(build_script(a.harness)))
        engine_args = ["--engine", "scripted", "--script", str(Path(d) / "script.json"), "--model-path", str(ckpt)]
        with launch_fake_sglang(engine_args) as eng:
            for c in a.concurrency:
                args = default_args(
                    hf_checkpoint=str(ckpt), sglang_router_ip="127.0.0.1", sglang_router_port=int(eng.url.rsplit(":", 1)[1]),
                    rollout_max_response_len=512, rollout_max_context_len=32768, agent_harness=a.harness,
                    agent_codex_sandbox="bypass", agent_timeout=300.0, agent_cli_concurrency=c,
                    agent_sandbox_dir=str(Path(d) / "sandboxes"), prompt_data=str(TASKS),
                )  # fmt: skip

                async def go(args: Any = args, c: int = c) -> tuple[list[dict[str, Any]], float]:
                    await run_batch(args, rows, 1, 1)  # warm-up: CLI caches, gateway start
                    t0 = time.monotonic()
                    eps = await run_batch(args, rows, a.episodes, c)
                    wall = time.monotonic() - t0
                    await stop_embedded_gateway()
                    return eps, wall

                eps, wall = asyncio.run(go())
                mean = {
                    k: statistics.mean(e[k] for e in eps) for k in ("boot_seconds", "agent_seconds", "score_seconds")
                }
                results[str(c)] = {
                    "episodes": len(eps),
                    "wall_seconds": round(wall, 2),
                    "episodes_per_minute": round(60 * len(eps) / wall, 2),
                    "mean_seconds": {k: round(v, 3) for k, v in mean.items()},
                    "all_rewards_as_known": all(e["ok"] for e in eps),
                }
                print(f"concurrency {c}: {results[str(c)]}", file=sys.stderr, flush=True)
    base = results[str(a.concurrency[0])]["episodes_per_minute"]
    print(f"\n{a.harness}, {a.episodes} episodes per row, {os.cpu_count()} cores")
    print(f"{'concurrency':>11} {'ep/min':>7} {'x':>5} {'boot s':>7} {'agent s':>8} {'score s':>8} {'rewards ok':>10}")
    for c, r in results.items():
        m = r["mean_seconds"]
        print(
            f"{c:>11} {r['episodes_per_minute']:>7.1f} {r['episodes_per_minute'] / base:>5.2f} {m['boot_seconds']:>7.2f}"
            f" {m['agent_seconds']:>8.2f} {m['score_seconds']:>8.2f} {str(r['all_rewards_as_known']):>10}"
        )
    out = {
        "harness": a.harness,
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.node()} {os.cpu_count()} cores {platform.processor() or platform.machine()}",
        "results": results,
    }
    Path(a.out_json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out_json).write_text(json.dumps(out, indent=1))
    print(f"wrote {a.out_json}")


if __name__ == "__main__":
    main()
