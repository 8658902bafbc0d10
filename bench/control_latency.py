"""How long one control request to an engine takes after both sides slept: the weight sync's session makes five.

    .venv/bin/python -m bench.control_latency [--gaps-ms 0 2 5 10 20] [--repeats 200] \
        [--out bench/results/control_latency.json]

Why: inside a colocated weight sync the session's calls (pause, flush, begin ... end, continue) take 0.3-1 ms each
on the H200 host though the fake engine's handlers run for under 0.2 ms and a round trip in a tight loop takes
~0.3 ms (docs/performance.md). Between them both processes block (the trainer on the engine, the engine on its
event loop), so this times a `GET /get_server_info` through `SGLangClient` after the client slept for each gap,
against a fake `synthetic` engine on this machine. Prints a table (median, p90, ratio to the tight loop) and
writes JSON. Never asserts: the numbers belong to the machine.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

from tqdm import tqdm

from bench.run_cpu import write_result

logger = logging.getLogger(__name__)


def measure(url: str, gaps_s: list[float], repeats: int) -> list[dict[str, float]]:
    """Per gap: median and p90 of `repeats` round trips, each after sleeping that long (the first tenth dropped)."""
    from slime.backends.sglang.client import SGLangClient

    client = SGLangClient(url)
    rows = []
    try:
        for gap in tqdm(gaps_s, desc="gaps", unit="gap"):
            times = []
            for _ in range(repeats):
                if gap:
                    time.sleep(gap)
                t0 = time.perf_counter()
                client.request("GET", "/get_server_info")
                times.append(time.perf_counter() - t0)
            kept = sorted(times[repeats // 10 :])
            rows.append({"gap_s": gap, "median_s": statistics.median(kept), "p90_s": kept[int(0.9 * (len(kept) - 1))]})
    finally:
        client.close()
    return rows


def report(rows: list[dict[str, float]]) -> str:
    base = rows[0]["median_s"]
    lines = ["| slept before the request | median | p90 | × the first row |", "|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['gap_s'] * 1e3:g} ms | {r['median_s'] * 1e3:.3f} ms | {r['p90_s'] * 1e3:.3f} ms | "
            f"{r['median_s'] / base:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gaps-ms", type=float, nargs="+", default=[0, 2, 5, 10, 20])
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--out", default="bench/results/control_latency.json")
    a = p.parse_args(argv)
    from sim.fake_sglang.testing import launch_fake_sglang

    with launch_fake_sglang(["--engine", "synthetic"]) as engine:
        rows = measure(engine.url, [g / 1e3 for g in a.gaps_ms], a.repeats)
    print(report(rows))
    return write_result(a.out, {"repeats": a.repeats, "rows": rows})


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    main()
