"""Wall time of the quick start (`examples/toy/quickstart.py`, what `bash examples/toy/run_toy.sh` runs after
the install): SFT warm-up, then GRPO until the held-out eval reward reaches the target.

Each repeat is a fresh `--out` directory (checkpoint, task and runs rebuilt), so a repeat measures what a
newcomer waits for. Prints one row per repeat and the median, writes `--out-json`.

    .venv/bin/python -m bench.quickstart [--repeats 1] [--out-json bench/results/quickstart.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def one_run(out: Path, extra: list[str]) -> dict[str, Any]:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "examples.toy.quickstart", "--out", str(out), *extra], cwd=ROOT)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"quick start failed (exit {proc.returncode}); logs under {out}")
    res = json.loads((out / "learning.json").read_text())
    return {
        "reached_at_step": res["reached_at_step"],
        "final_eval": res["final_eval"],
        "sft_s": res["wall_s"]["sft"],
        "grpo_s": res["wall_s"]["grpo"],
        "total_s": round(wall, 1),
        "png": (out / "learning.png").exists(),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--out-json", default="bench/results/quickstart.json")
    p.add_argument("--keep", default=None, help="keep each run's directory under this path (default: temporary)")
    a, extra = p.parse_known_args(argv)
    rows = []
    for i in range(a.repeats):
        if a.keep:
            out = Path(a.keep).resolve() / f"run{i}"
            rows.append(one_run(out, extra))
        else:
            with tempfile.TemporaryDirectory(prefix="slime-quickstart-") as tmp:
                rows.append(one_run(Path(tmp), extra))
    print(f"\n{'run':>3} {'reached at':>10} {'final eval':>10} {'SFT s':>6} {'GRPO s':>7} {'total s':>8} {'png':>4}")
    for i, r in enumerate(rows):
        print(
            f"{i:>3} {str(r['reached_at_step']):>10} {r['final_eval']:>10.3f} {r['sft_s']:>6.0f} {r['grpo_s']:>7.0f} "
            f"{r['total_s']:>8.0f} {'yes' if r['png'] else 'no':>4}"
        )
    median = statistics.median(r["total_s"] for r in rows)
    print(f"median total {median:.0f} s over {len(rows)} run(s); target 300 s, limit 480 s: ratio {median / 300:.2f}")
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}",
        "extra_args": extra,
        "rows": rows,
        "median_total_s": median,
    }
    out_json = ROOT / a.out_json
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out_json}")
    return result


if __name__ == "__main__":
    main()
