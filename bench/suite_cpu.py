"""Where the CPU test suite's CPU goes, by process role.

    .venv/bin/python -m bench.suite_cpu [--pytest-args "-m cpu -n 2 -q"] [--json bench/results/suite_cpu.json]

On a 2-core machine the suite keeps both cores busy (vmstat: ~93% of the run), so its wall time is about its
CPU-seconds over two, and what shortens it is fewer CPU-seconds, wherever they are spent. This bench runs pytest
while sampling every process on the machine (psutil, every `--interval` s) and sums each process's last sampled
CPU time by role: bench/run_cpu.py's roles (Ray actors by class, Ray's daemons, engines, router, driver) plus the
test workers, the ranks they fork, other Python programs tests start (`python -m MODULE`), the agent CLIs and the
kernel's own threads. The sampling slows the suite by ~10%, so time the suite with bench/test_suite.py, not
here; a process that lives shorter than one interval is missed.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import psutil
from tqdm import tqdm

from bench.run_cpu import role as run_role
from bench.run_cpu import write_result

logger = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parents[1]


def role(cmdline: str, name: str) -> str:
    """A run's roles as in bench/run_cpu.py, and the suite's own processes."""
    if not cmdline:  # kernel threads have no command line
        return f"kernel {name.split('/')[0]}"
    if "xdist" in name or "xdist" in cmdline or " -m pytest" in cmdline:
        return "pytest (controller and workers)"
    if "multiprocessing.forkserver" in cmdline or "spawn_main" in cmdline:
        return "test ranks (fork server, spawned)"
    if "multiprocessing.resource_tracker" in cmdline:
        return "multiprocessing resource tracker"
    r = run_role(cmdline, name)
    if r != os.path.basename(cmdline.split()[0]):  # one of run_cpu's roles, not its fallback (the program)
        return r
    if name in ("claude", "codex") or "/claude" in cmdline or "/codex" in cmdline:
        return f"agent CLI {name}"
    parts = cmdline.split()
    if "-m" in parts[:-1]:
        return f"python -m {parts[parts.index('-m') + 1]}"
    return r


def sample(processes: dict[tuple[int, float], dict], me: int, since: float) -> None:
    """One look at every process: its CPU time since `since` (epoch seconds), or since it was first seen if it
    is older (the shell, the machine's daemons and kernel threads count only what they did during the suite)."""
    for p in psutil.process_iter(["pid", "name", "cmdline", "cpu_times", "create_time"]):
        info = p.info
        if info["pid"] == me or info["cpu_times"] is None:
            continue
        cpu = info["cpu_times"].user + info["cpu_times"].system
        key = (info["pid"], info["create_time"])
        if key not in processes:
            processes[key] = {"cmdline": "", "name": "", "base": cpu if info["create_time"] < since else 0.0}
        entry = processes[key]
        cmd = " ".join(info["cmdline"] or [])
        if cmd:  # a zombie's cmdline reads empty: keep what the live process showed
            entry["cmdline"] = cmd
        entry["name"] = info["name"] or entry["name"]
        entry["cpu_s"] = cpu - entry["base"]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pytest-args", default="-m cpu -n 2 -q", help="what to run, after `python -m pytest`")
    p.add_argument("--json", default="bench/results/suite_cpu.json")
    p.add_argument("--log", default="runs/suite_cpu.log", help="pytest's own output")
    p.add_argument("--interval", type=float, default=0.5, help="seconds between samples of every process")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    log = ROOT / a.log
    log.parent.mkdir(parents=True, exist_ok=True)
    processes: dict[tuple[int, float], dict] = {}
    busy0 = sum(psutil.cpu_times()[:3])
    since = time.time()
    sample(processes, os.getpid(), since)
    t0 = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pytest", *shlex.split(a.pytest_args)], cwd=ROOT, stdout=out, stderr=out
        )
        with tqdm(desc="suite", bar_format="{desc}: {elapsed} {postfix}", mininterval=2.0) as bar:
            while proc.poll() is None:
                sample(processes, os.getpid(), since)
                bar.set_postfix_str(f"{len(processes)} processes seen", refresh=False)
                bar.update(0)
                time.sleep(a.interval)
    wall = time.perf_counter() - t0
    busy = sum(psutil.cpu_times()[:3]) - busy0  # user + nice + system of the whole machine
    rows: dict[str, dict] = {}
    for e in processes.values():
        r = rows.setdefault(role(e["cmdline"], e["name"]), {"processes": 0, "cpu_s": 0.0})
        r["processes"] += 1
        r["cpu_s"] += e.get("cpu_s", 0.0)
    table = sorted(
        ({"role": k, "processes": v["processes"], "cpu_s": round(v["cpu_s"], 1)} for k, v in rows.items()
         if v["cpu_s"] >= 0.5),
        key=lambda r: -r["cpu_s"],
    )  # fmt: skip
    total = sum(r["cpu_s"] for r in table)
    print(f"\n{'role':<40} {'procs':>5} {'CPU-s':>8} {'share':>6}")
    for r in table:
        print(f"{r['role']:<40} {r['processes']:>5} {r['cpu_s']:>8.1f} {r['cpu_s'] / total:>6.0%}")
    print(f"{'total sampled':<40} {'':>5} {total:>8.1f}   machine busy {busy:.0f} CPU-s, wall {wall:.0f} s")
    print(f"pytest exit code {proc.returncode}; its output: {log}")
    return write_result(a.json, {
        "pytest_args": a.pytest_args, "returncode": proc.returncode, "wall_s": round(wall, 1),
        "machine_busy_cpu_s": round(busy, 1), "sampled_cpu_s": round(total, 1), "roles": table,
    })  # fmt: skip


if __name__ == "__main__":
    main()
