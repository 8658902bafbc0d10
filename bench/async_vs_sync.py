"""Does fully-async training pay on a long-tailed workload, and what does the staleness bound cost?

    .venv/bin/python -m bench.async_vs_sync [--horizon 3600] [--seed 0] [--out-json ...] [--png ...]
    .venv/bin/python -m bench.async_vs_sync --in-flight-table --workload bimodal|agent|long_tail [-k 2]

Runs the scheduling simulator (`sim/scheduling`: slime's own loop driver, rollout function, fully-async producer,
buffer and staleness filter against simulated engines and a simulated trainer, on a virtual clock) for one
simulated hour per schedule: sync, one-step-ahead, partial rollout (over-sampling 2x), and fully async at staleness
bounds k = 1, 2, 4 and unbounded. The workload is `sim/workloads/long_tail.py`'s default (documented there and in
docs/async.md); fully async keeps 3 x the engines' slots of samples in flight (`--async-max-concurrent-samples`:
a group holds its slots until its slowest sample ends, so whole-group accounting needs headroom to keep slots
busy).

`--in-flight-table` compares weight syncs drained (SGLang's `abort` pause: every request is cut and resumed,
prefilling its context again) with in flight (`--update-weights-in-flight`, the `in_place` pause) at one bound
k, under the `retry` and the per-token `mask` rule, on one of `sim/workloads/long_tail.py`'s workloads; it
writes `bench/results/in_flight_<workload>.json` and no plot.

Prints the table first, then writes the JSON and the plot of throughput against k. A bench, not a test: it
never asserts; the numbers are deterministic for a seed and do not depend on the machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
logger = logging.getLogger("bench.async_vs_sync")


def configs(horizon: float, in_flight: int, handler: str) -> list[Any]:
    from sim.scheduling.run import SimConfig

    out = [
        SimConfig("sync", horizon_s=horizon),
        SimConfig("one_step", horizon_s=horizon),
        SimConfig("partial", horizon_s=horizon, over_sampling=2.0),
    ]
    for k in (1, 2, 4, None):
        out.append(
            SimConfig(
                "fully_async", max_staleness=k, unused_handler=handler, max_concurrent_samples=in_flight,
                horizon_s=horizon,
            )
        )  # fmt: skip
    return out


def in_flight_configs(horizon: float, in_flight: int, k: int) -> list[Any]:
    from sim.scheduling.run import SimConfig

    out = [SimConfig("sync", horizon_s=horizon)]
    for handler in ("retry", "mask"):
        for live in (False, True):
            out.append(
                SimConfig(
                    "fully_async", max_staleness=k, unused_handler=handler, max_concurrent_samples=in_flight,
                    horizon_s=horizon, in_flight=live,
                )
            )  # fmt: skip
    return out


def in_flight_table(rows: list[dict[str, Any]]) -> str:
    sync = next(r for r in rows if r["mode"] == "sync")
    head = (
        f"{'schedule':<36} {'samples/s':>9} {'x sync':>7} {'trained tok/s':>13} {'x sync':>7} "
        f"{'prefill/trained tok':>19} {'wasted':>7} {'masked':>7} {'dropped':>7} {'retried':>7} {'aborted':>7}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['label']:<36} {r['samples_per_s']:>9.3f} {r['samples_per_s'] / sync['samples_per_s']:>6.2f}x "
            f"{r['trained_tokens_per_s']:>13.0f} {r['trained_tokens_per_s'] / sync['trained_tokens_per_s']:>6.2f}x "
            f"{r['prefill_per_trained_token']:>19.2f} {r['wasted_token_fraction']:>7.1%} "
            f"{r['masked_token_fraction']:>7.1%} {r['dropped_groups']:>7} {r['retried_groups']:>7} "
            f"{r['aborted_groups']:>7}"
        )
    return "\n".join(lines)


def table(rows: list[dict[str, Any]]) -> str:
    sync = next(r for r in rows if r["mode"] == "sync")["samples_per_s"]
    head = (
        f"{'schedule':<26} {'samples/s':>9} {'x sync':>7} {'engines busy':>12} {'trainer idle':>12} "
        f"{'staleness mean':>14}  {'staleness histogram':<46} {'dropped':>7} {'retried':>7} {'wasted tokens':>13}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        hist = " ".join(f"{k}:{v}" for k, v in r["staleness_hist"].items())
        lines.append(
            f"{r['label']:<26} {r['samples_per_s']:>9.3f} {r['samples_per_s'] / sync:>6.2f}x {r['engine_busy']:>12.1%} "
            f"{r['trainer_idle']:>12.1%} {r['staleness_mean']:>14.2f}  {hist:<46} {r['dropped_groups']:>7} "
            f"{r['retried_groups']:>7} {r['wasted_token_fraction']:>13.1%}"
        )
    return "\n".join(lines)


def plot(path: Path, rows: list[dict[str, Any]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fa = [r for r in rows if r["mode"] == "fully_async"]
    bounded = [r for r in fa if r["max_staleness"] is not None]
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    ax.plot([r["max_staleness"] for r in bounded], [r["samples_per_s"] for r in bounded], "o-", color="tab:blue",
            label="fully async, bound k")  # fmt: skip
    unbounded = next((r for r in fa if r["max_staleness"] is None), None)
    if unbounded is not None:
        ax.axhline(unbounded["samples_per_s"], color="tab:blue", ls=":", label="fully async, no bound")
    styles = {"sync": ("black", "--"), "one_step": ("tab:orange", "--"), "partial": ("tab:green", "--")}
    for r in rows:
        if r["mode"] in styles:
            color, ls = styles[r["mode"]]
            ax.axhline(r["samples_per_s"], color=color, ls=ls, label=r["label"].replace("_", "-"))
    for r in bounded:
        ax.annotate(f"busy {r['engine_busy']:.0%}", (r["max_staleness"], r["samples_per_s"]),
                    textcoords="offset points", xytext=(4, -12), fontsize=8)  # fmt: skip
    ax.set_xlabel("staleness bound k (--max-weight-staleness)")
    ax.set_ylabel("trained samples per simulated second")
    ax.set_xticks([r["max_staleness"] for r in bounded])
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(loc="center right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--horizon", type=float, default=3600.0, help="simulated seconds per schedule")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--handler", choices=["retry", "drop"], default="retry", help="--async-unused-samples-handler")
    p.add_argument("--in-flight", type=int, default=None, help="fully-async samples in flight (default 3 x slots)")
    p.add_argument("--workload", choices=["long_tail", "bimodal", "agent"], default="long_tail")
    p.add_argument("--in-flight-table", action="store_true", help="drained vs in-flight weight syncs at bound -k")
    p.add_argument("-k", type=int, default=2, help="the staleness bound of --in-flight-table")
    p.add_argument("--out-json", default=None, help="default: bench/results/async_vs_sync.json or in_flight_<w>")
    p.add_argument("--png", default=str(ROOT / "docs" / "img" / "async_vs_sync.png"))
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("slime").setLevel(logging.WARNING)  # one line per simulated rollout would bury the table
    from sim.scheduling.run import simulate
    from sim.workloads.long_tail import WORKLOADS

    workload = WORKLOADS[a.workload].replace(seed=a.seed)
    in_flight = a.in_flight or 3 * workload.engines * workload.slots_per_engine
    if a.out_json is None:
        name = f"in_flight_{a.workload}.json" if a.in_flight_table else "async_vs_sync.json"
        a.out_json = str(ROOT / "bench" / "results" / name)
    todo = (
        in_flight_configs(a.horizon, in_flight, a.k) if a.in_flight_table else configs(a.horizon, in_flight, a.handler)
    )
    rows = []
    t0 = time.perf_counter()
    for cfg in tqdm(todo, desc="schedules", file=sys.stderr):
        t1 = time.perf_counter()
        rows.append({**simulate(cfg, workload).report(), "wall_s": time.perf_counter() - t1})
    print(in_flight_table(rows) if a.in_flight_table else table(rows), flush=True)
    sync = next(r for r in rows if r["mode"] == "sync")["samples_per_s"]
    out = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}",
        "argv": sys.argv[1:] if argv is None else argv,
        "horizon_s": a.horizon,
        "fully_async_in_flight_samples": in_flight,
        "workload": workload.to_dict(),
        "rows": rows,
        "speedup_vs_sync": {r["label"]: r["samples_per_s"] / sync for r in rows},
        "wall_s": time.perf_counter() - t0,
    }
    Path(a.out_json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out_json).write_text(json.dumps(out, indent=1) + "\n")
    if a.in_flight_table:
        logger.info("wrote %s (%.0f s)", a.out_json, out["wall_s"])
        return out
    title = f"simulated {a.horizon / 3600:g} h, {workload.engines} engines x {workload.slots_per_engine} slots, seed {a.seed}"
    plot(Path(a.png), rows, title)
    logger.info("wrote %s and %s (%.0f s)", a.out_json, a.png, out["wall_s"])
    return out


if __name__ == "__main__":
    main()
