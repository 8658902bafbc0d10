"""Where one `slime train` run's CPU goes, process by process.

    .venv/bin/python -m bench.run_cpu [--out runs/run_cpu] [--json bench/results/run_cpu.json] [--interval 0.2]

On a 2-core machine the test suite runs two such jobs at once, so its time is set by the CPU-seconds each run
spends, not by their wall time; nearly all of that is Python processes importing torch, transformers and
megatron-core. This bench runs the toy job of `tests/integration/test_toy_e2e.py` (2 fake `hf` engines behind
the real router, one train actor, 3 rollouts) and samples every descendant's CPU time (`sim/process_tree.py`) until it ends:
it prints one row per process role (driver, each Ray actor class, engines, router, Ray's own daemons), the
total, the wall time, and when each role started, and writes them as JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from tqdm import tqdm

from sim.process_tree import ProcessTreeWatcher
from sim.slime_run import slime_train

logger = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parents[1]


def role(cmdline: str, name: str) -> str:
    """A stable label for a process: Ray retitles its workers `ray::Class.method`, so keep the class only."""
    if cmdline.startswith("ray::"):
        head = cmdline.split()[0][5:].split(".")[0]
        return f"ray::{head}"  # IDLE: a worker that never became an actor
    if "sim.fake_sglang" in cmdline:
        return "fake engine"
    if "sglang::router" in name or "sglang_router" in cmdline:
        return "sglang router"
    if "slime train" in cmdline or "slime.cli" in cmdline:
        return "driver"
    for daemon in ("gcs_server", "raylet", "dashboard.py", "log_monitor.py", "monitor.py", "runtime_env"):
        if daemon in cmdline:
            return f"ray {daemon.removesuffix('.py')}"
    return os.path.basename(cmdline.split()[0]) if cmdline else name


def toy_argv(assets: Path, metrics: Path) -> list[str]:
    return [
        "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--num-rollout", "3", "--global-batch-size", "16",
        "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1", "--rollout-max-response-len", "10",
        "--custom-megatron-init-path", "sim.fake_megatron.cpu_shim.apply", "--lr", "1e-4",
        "--hf-checkpoint", str(assets / "model"), "--prompt-data", str(assets / "data" / "train.jsonl"),
        "--input-key", "input", "--label-key", "label", "--apply-chat-template",
        "--custom-rm-path", "examples.toy.reward.reverse_digits_rm",
        "--rollout-num-gpus", "2", "--rollout-engine", "sim", "--sim-engine", "hf", "--metrics-dir", str(metrics),
    ]  # fmt: skip


def profile(argv: list[str], log: Path, interval: float) -> dict:
    """Run `slime train ARGV` (supervised: nothing outlives an interrupted bench) while a `ProcessTreeWatcher`
    samples its process tree; returns per-pid (role, CPU-seconds, first seen) and the wall time."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    t0 = time.perf_counter()
    with slime_train(argv, log, env) as proc:
        watcher = ProcessTreeWatcher(proc.pid, interval=interval)
        with tqdm(desc="toy run", bar_format="{desc}: {elapsed} {postfix}", mininterval=1.0) as bar:
            while proc.poll() is None:
                cpu_s = sum(watcher.cpu_s.values())
                bar.set_postfix_str(f"{len(watcher.cpu_s)} processes, {cpu_s:.0f} CPU-s", refresh=False)
                bar.update(0)  # redraws at most once per mininterval
                time.sleep(interval)
        watcher.stop()
    processes = {
        pid: {"role": role(watcher.cmdlines.get(pid, ""), watcher.names.get(pid, "")), "cpu_s": cpu,
              "start_s": watcher.first_seen_s[pid]}
        for pid, cpu in watcher.cpu_s.items()
    }  # fmt: skip
    return {"returncode": proc.returncode, "wall_s": time.perf_counter() - t0, "processes": processes}


def summarize(processes: dict[int, dict]) -> list[dict]:
    rows: dict[str, dict] = {}
    for e in processes.values():
        r = rows.setdefault(
            e["role"], {"role": e["role"], "processes": 0, "cpu_s": 0.0, "first_start_s": e["start_s"]}
        )
        r["processes"] += 1
        r["cpu_s"] += e["cpu_s"]
        r["first_start_s"] = min(r["first_start_s"], e["start_s"])
    return sorted(({**r, "cpu_s": round(r["cpu_s"], 1), "first_start_s": round(r["first_start_s"], 1)}
                   for r in rows.values()), key=lambda r: -r["cpu_s"])  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/run_cpu", help="assets, metrics and the run's log")
    p.add_argument("--json", default="bench/results/run_cpu.json")
    p.add_argument("--interval", type=float, default=0.2, help="seconds between samples of the process tree")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    # engines forked from a test session's zygote would run outside the run's process tree, unmeasured
    os.environ.pop("SLIME_SIM_ZYGOTE", None)
    out = (ROOT / a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    assets = out / "assets"
    if not (assets / "model").exists():
        subprocess.run([sys.executable, "-m", "examples.toy.prepare", "--out", str(assets), "--num-train", "64",
                        "--num-eval", "8"], cwd=ROOT, check=True)  # fmt: skip
    res = profile(toy_argv(assets, out / "metrics"), out / "run.log", a.interval)
    if res["returncode"] != 0:
        sys.exit(f"the toy run failed (exit {res['returncode']}); its output: {out / 'run.log'}")
    rows = summarize(res["processes"])
    total = sum(r["cpu_s"] for r in rows)
    print(f"\n{'role':<22} {'procs':>5} {'CPU-s':>7} {'share':>6} {'starts at':>9}")
    for r in rows:
        print(
            f"{r['role']:<22} {r['processes']:>5} {r['cpu_s']:>7.1f} {r['cpu_s'] / total:>6.0%} {r['first_start_s']:>8.1f}s"
        )
    print(f"{'total':<22} {len(res['processes']):>5} {total:>7.1f}   wall {res['wall_s']:.1f} s")
    return write_result(a.json, {"wall_s": round(res["wall_s"], 1), "total_cpu_s": round(total, 1), "roles": rows})


def write_result(path: str, fields: dict) -> dict:
    """`fields` with the date and the machine, as JSON at `path` (relative to the repository root)."""
    result = {
        "date": datetime.datetime.now().isoformat(timespec="minutes"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        **fields,
    }
    dest = ROOT / path
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(result, indent=1) + "\n")
    logger.info("wrote %s", dest)
    return result


if __name__ == "__main__":
    main()
