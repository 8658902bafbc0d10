"""Does fully-async GRPO learn the toy task as well as the synchronous loop, from the same SFT checkpoint?

    .venv/bin/python -m bench.toy_async [--out runs/toy_async] [--max-weight-staleness 1] [--in-flight] \
        [quick-start flags]

1. The quick start's SFT warm-up, once (or `--sft-checkpoint DIR` to reuse one).
2. The quick start's GRPO job, synchronous, stopped at the first held-out eval >= `--target` (or `--rl-max-steps`).
3. The same job with `--fully-async --max-weight-staleness K`, stopped the same way.
4. With `--in-flight`, also that job with `--update-weights-in-flight` (requests run on through each sync).

Every run is the real `slime train` (fake `hf` engines behind the real router, megatron-core on CPU). Prints a
table of both eval curves, writes `OUT/toy_async.json` and draws `OUT/toy_async.png` (held-out reward against
the step and against wall time). A bench, not a test: it never asserts. On a 2-core CPU machine the engines
and the trainer share the same two cores, so fully async cannot be faster here in wall time: the question this
answers is whether it learns as well; the speed-up is the simulator's (`bench/async_vs_sync.py`).
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

from examples.toy import quickstart

ROOT = Path(__file__).resolve().parents[1]
logger = logging.getLogger("bench.toy_async")


def wall_curve(metrics_dir: Path, name: str = "toy") -> list[tuple[int, float, float]]:
    """(step, held-out reward, seconds since the run's first record) of every eval."""
    records = [json.loads(x) for x in (metrics_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    t0 = min(r["wall_time"] for r in records)
    key = f"eval/{name}"
    return [(r["step"], float(r["metrics"][key]), r["wall_time"] - t0) for r in records
            if r["kind"] == "eval" and key in r["metrics"]]  # fmt: skip


def plot(path: Path, runs: dict[str, dict[str, Any]], target: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for (label, run), color in zip(runs.items(), ("tab:gray", "tab:blue", "tab:orange"), strict=False):
        curve = run["curve"]
        name = f"{label} ({run['wall_s']:.0f} s)"
        by_step.plot([s for s, _, _ in curve], [v for _, v, _ in curve], "o-", color=color, label=name)
        by_time.plot([t for _, _, t in curve], [v for _, v, _ in curve], "o-", color=color, label=name)
    for ax in (by_step, by_time):
        ax.axhline(target, color="tab:green", ls=":", label=f"target {target}")
        ax.grid(alpha=0.3)
        ax.set_ylim(0, 1.02)
    by_step.set_xlabel("GRPO step (step 0: the SFT checkpoint)")
    by_time.set_xlabel("wall time of the GRPO run (s)")
    by_step.set_ylabel("reward on held-out prompts (T = 1)")
    by_step.legend(loc="lower right", fontsize=8)
    fig.suptitle("toy task from one SFT checkpoint: synchronous vs fully-async GRPO (drained, in flight)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--max-weight-staleness", type=int, default=1)
    p.add_argument("--sft-checkpoint", default=None, help="an HF checkpoint to start GRPO from (skips SFT)")
    p.add_argument("--in-flight", action="store_true", help="a third run: fully async with --update-weights-in-flight")
    mine, rest = p.parse_known_args(argv)
    a, extra = quickstart.parse_args(["--out", "runs/toy_async", *rest] if "--out" not in rest else rest)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    from examples.toy.prepare import prepare

    out = (ROOT / a.out).resolve() if not os.path.isabs(a.out) else Path(a.out)
    os.environ.setdefault("SLIME_CPU_THREADS", str(os.cpu_count() or 1))
    # the runs import this checkout's slime even where the environment has another one installed
    os.environ["PYTHONPATH"] = os.pathsep.join(x for x in (str(ROOT), os.environ.get("PYTHONPATH")) if x)
    paths = prepare(out / "assets", num_train=a.num_train, num_eval=128, model_kwargs=quickstart.MODEL)
    walls: dict[str, float] = {}
    sft = Path(mine.sft_checkpoint) if mine.sft_checkpoint else out / "sft_hf"
    if mine.sft_checkpoint is None:
        logger.info("SFT warm-up: %d steps", a.sft_steps)
        walls["sft"] = quickstart.run(quickstart.sft_flags(a, paths, sft), out / "sft")
    job = [*quickstart.grpo_flags(a, paths, sft), *extra]
    schedules = {
        "sync": [],
        f"fully async, k={mine.max_weight_staleness}": [
            "--fully-async",
            "--max-weight-staleness",
            str(mine.max_weight_staleness),
        ],  # fmt: skip
    }
    if mine.in_flight:
        async_flags = next(iter(f for f in schedules.values() if f))
        schedules[f"in flight, k={mine.max_weight_staleness}"] = [*async_flags, "--update-weights-in-flight"]
    runs: dict[str, dict[str, Any]] = {}
    for i, (label, flags) in enumerate(schedules.items()):
        logger.info("GRPO %d/%d: %s, until the held-out reward reaches %.2f", i + 1, len(schedules), label, a.target)
        metrics = out / ("grpo_sync" if not flags else "grpo_fully_async")
        if "--update-weights-in-flight" in flags:
            metrics = out / "grpo_in_flight"
        wall = quickstart.run([*job, *flags], metrics, stop_at=a.target)
        curve = wall_curve(metrics)
        reached = next((s for s, v, _ in curve if v >= a.target), None)
        runs[label] = {"wall_s": wall, "curve": curve, "reached_at_step": reached,
                       "best_eval": max((v for _, v, _ in curve), default=None), "metrics_dir": str(metrics)}  # fmt: skip
    rows = [f"{'schedule':<20} {'step':>5} {'held-out reward':>16} {'wall s':>8}"]
    for label, run in runs.items():
        rows += [f"{label:<20} {s:>5} {v:>16.3f} {t:>8.0f}" for s, v, t in run["curve"]]
    print("\n".join(rows), flush=True)
    for label, run in runs.items():
        print(f"{label}: reached {a.target} at step {run['reached_at_step']}, best {run['best_eval']}, "
              f"{run['wall_s']:.0f} s")  # fmt: skip
    result = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}",
        "argv": sys.argv[1:] if argv is None else argv,
        "target": a.target, "sft_checkpoint": str(sft), "sft_wall_s": walls.get("sft"), "runs": runs,
    }  # fmt: skip
    (out / "toy_async.json").write_text(json.dumps(result, indent=1))
    plot(out / "toy_async.png", runs, a.target)
    logger.info("wrote %s and %s", out / "toy_async.json", out / "toy_async.png")
    return result


if __name__ == "__main__":
    t = time.perf_counter()
    main()
    logger.info("total %.0f s", time.perf_counter() - t)
