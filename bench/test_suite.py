"""Wall time of the CPU test suite, run several times: single runs on a shared 2-core machine vary by ±20%, so the
suite's targets are stated as medians.

    .venv/bin/python -m bench.test_suite [--marker "cpu and not slow"] [--repeats 3] [--workers 2] [--ci]
        [--target-s 180]   (the whole CPU suite: --marker cpu --target-s 480)

Runs `pytest -m MARKER -n WORKERS` from the repository root as the README does (without `CI=true` unless `--ci`:
CI's hypothesis profile runs 200 examples per property instead of 40), prints one line per run and a table, and
writes `bench/results/test_suite.json` (or `--out`; each run's pytest output in `runs/test_suite/`). A run that fails or skips tests is reported as such.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

logger = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parents[1]
SUMMARY = re.compile(r"^=*\s*(?P<body>\d+ \w+.*?) in (?P<secs>[\d.]+)s", re.M)  # with or without -q's '=' rule


def parse_summary(output: str) -> dict[str, float | int]:
    """pytest's last line, e.g. '705 passed, 2 skipped, 14 warnings in 241.58s' -> counts and seconds."""
    found = SUMMARY.findall(output)
    if not found:
        raise ValueError("no pytest summary line in the output")
    body, secs = found[-1]
    counts: dict[str, float | int] = {"pytest_s": float(secs)}
    for n, what in re.findall(r"(\d+) (\w+)", body):
        counts[what] = int(n)
    return counts


def run_once(marker: str, workers: int, ci: bool, log: Path) -> dict[str, float | int]:
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # as .ci/run: children load cached bytecode
    if ci:
        env["CI"] = "true"
    else:
        env.pop("CI", None)
    cmd = [sys.executable, "-m", "pytest", "-m", marker, "-n", str(workers), "-q"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    log.write_text(proc.stdout + proc.stderr)
    out = {"wall_s": round(wall, 1), "returncode": proc.returncode, **parse_summary(proc.stdout)}
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--marker", default="cpu and not slow")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--ci", action="store_true", help="CI=true (hypothesis's 200-example profile)")
    p.add_argument("--target-s", type=float, default=180.0, help="the target the median is held against")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "test_suite.json"))
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    runs = []
    for i in range(a.repeats):
        log = ROOT / "runs" / "test_suite" / f"run{i}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        r = run_once(a.marker, a.workers, a.ci, log)
        runs.append(r)
        logger.info(
            "run %d/%d: %.1f s wall, %s passed, %s skipped, %s failed (log %s)",
            i + 1, a.repeats, r["wall_s"], r.get("passed", 0), r.get("skipped", 0), r.get("failed", 0), log,
        )  # fmt: skip
    walls = [r["wall_s"] for r in runs]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    res = {
        "date": datetime.datetime.now().isoformat(timespec="minutes"),
        "commit": commit.stdout.strip(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}",
        "command": f'pytest -m "{a.marker}" -n {a.workers}' + (" (CI=true)" if a.ci else ""),
        "runs": runs,
        "median_wall_s": statistics.median(walls),
        "target_s": a.target_s,
        "median_over_target": round(statistics.median(walls) / a.target_s, 3),
        "all_passed": all(r["returncode"] == 0 and not r.get("skipped") for r in runs),
    }
    out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"\n{res['command']} on {res['machine']}, commit {res['commit']}")
    print("| run | wall s | passed | skipped | failed |\n|---|---|---|---|---|")
    for i, r in enumerate(runs):
        print(f"| {i + 1} | {r['wall_s']} | {r.get('passed', 0)} | {r.get('skipped', 0)} | {r.get('failed', 0)} |")
    print(f"median {res['median_wall_s']} s = {res['median_over_target']} × the {a.target_s:.0f} s target; "
          f"every run passed with 0 skipped: {res['all_passed']}; JSON {out}")  # fmt: skip
    return res


if __name__ == "__main__":
    main()
