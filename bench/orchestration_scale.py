"""Does slime's driver stay linear at 128 and 512 engines and 1k-100k samples per step?

    .venv/bin/python -m bench.orchestration_scale [--samples 1000 10000 100000] [--engines 128 512] [--steps 3]

Runs slime's real loop driver, fully-async producer, buffer, staleness rule (`mask`), data source and per-sample
generate path (`generate_and_rm`: semaphore, masks, reward) in the scheduling simulator, with in-flight weight
updates, against engines modelled as independent slots (`sim/scheduling/slot_pool.py`: O(1) simulator work per
request, so what grows is the driver's). Each configuration runs in a fresh interpreter and reports:

- driver CPU per trained sample (µs): the process's CPU time over the run divided by the samples trained,
  simulator included (its share is constant per request);
- memory per in-flight sample (KiB): peak RSS minus the RSS before the run, over the samples the producer keeps
  in flight (2 x a step's);
- both with Python's default collector thresholds and with the RolloutManager's (`slime/utils/gc_policy.py`).

Tiny samples (prompts ~16 tokens, answers ~32): the point is per-sample bookkeeping, not token lists. A bench,
not a test: prints a table, writes bench/results/orchestration_scale.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
logger = logging.getLogger("bench.orchestration_scale")


def one(engines: int, samples: int, steps: int, relaxed: bool) -> dict[str, Any]:
    """One configuration, in this process (called in a fresh interpreter by `main`)."""
    logging.disable(logging.CRITICAL)  # one line per step would be the largest cost at 100k samples
    from sim.scheduling.run import SimConfig, simulate
    from sim.workloads.long_tail import Workload
    from slime.utils.gc_policy import relax_gc_for_rollouts

    if relaxed:
        relax_gc_for_rollouts()
    n = 8
    w = Workload(
        response_median=32, response_sigma=0.5, max_new_tokens=256, prompt_median=16, prompt_min=4, prompt_max=64,
        engines=engines, slots_per_engine=max(1, samples // engines), rollout_batch_size=samples // n,
        n_samples_per_prompt=n, train_step_s=1.0, train_per_token_s=0.0, weight_sync_s=0.5,
    )  # fmt: skip
    c = SimConfig(
        "fully_async", max_staleness=2, unused_handler="mask", max_steps=steps, max_concurrent_samples=2 * samples,
        in_flight=True, engine_model="slots",
    )  # fmt: skip
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0, w0 = time.process_time(), time.perf_counter()
    r = simulate(c, w)
    cpu, wall = time.process_time() - t0, time.perf_counter() - w0
    trained = r.report()["trained_samples"]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {
        "engines": engines, "samples_per_step": samples, "steps": steps, "gc": "relaxed" if relaxed else "default",
        "trained_samples": trained, "cpu_s": cpu, "wall_s": wall, "cpu_us_per_sample": cpu / trained * 1e6,
        "in_flight_samples": 2 * samples, "kib_per_in_flight_sample": (peak - rss0) / (2 * samples),
    }  # fmt: skip


def table(rows: list[dict[str, Any]]) -> str:
    head = f"{'engines':>7} {'samples/step':>12} {'gc':>8} {'CPU µs/sample':>13} {'x at 1k':>7} {'KiB/in-flight sample':>20}"
    lines = [head, "-" * len(head)]
    base = {
        (r["engines"], r["gc"]): r["cpu_us_per_sample"]
        for r in rows
        if r["samples_per_step"] == min(x["samples_per_step"] for x in rows)
    }
    for r in rows:
        ratio = r["cpu_us_per_sample"] / base[(r["engines"], r["gc"])]
        lines.append(
            f"{r['engines']:>7} {r['samples_per_step']:>12} {r['gc']:>8} {r['cpu_us_per_sample']:>13.1f} "
            f"{ratio:>6.2f}x {r['kib_per_in_flight_sample']:>20.2f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--samples", type=int, nargs="+", default=[1000, 10000, 100000])
    p.add_argument("--engines", type=int, nargs="+", default=[128, 512])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--one", nargs=3, metavar=("ENGINES", "SAMPLES", "GC"), help=argparse.SUPPRESS)
    p.add_argument("--out-json", default=str(ROOT / "bench" / "results" / "orchestration_scale.json"))
    a = p.parse_args(argv)
    if a.one:
        print(json.dumps(one(int(a.one[0]), int(a.one[1]), a.steps, a.one[2] == "relaxed")))
        return {}
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    rows = []
    t0 = time.perf_counter()
    for engines in a.engines:
        for samples in a.samples:
            for gc_mode in ("default", "relaxed"):
                cmd = [sys.executable, "-m", "bench.orchestration_scale", "--steps", str(a.steps), "--one",
                       str(engines), str(samples), gc_mode]  # fmt: skip
                out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout
                rows.append(json.loads(out.strip().splitlines()[-1]))
                logger.info("%s", rows[-1])
    print(table(rows), flush=True)
    result = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "argv": sys.argv[1:] if argv is None else argv,
        "rows": rows,
        "wall_s": time.perf_counter() - t0,
    }
    Path(a.out_json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out_json).write_text(json.dumps(result, indent=1) + "\n")
    logger.info("wrote %s (%.0f s)", a.out_json, result["wall_s"])
    return result


if __name__ == "__main__":
    main()
