"""Faults of every actor kind at every point of the toy job, N repetitions a row: survived, restarted, lost and
repeated prompts (docs/performance.md, "Trainer and actor faults").

Each repetition is one `slime train --max-restarts R` of the toy job (`sim/fault_job.py`: 4 rollouts of 10
prompts, a checkpoint after each) with one fault injected once per job (`SLIME_FAULT`, `SLIME_FAULT_MARKER`;
slime/utils/faults.py). A repetition **survived** when the fault fired, the job exited 0, all 4 rollouts trained
with 40 samples in all, and the dumps of the final lineage hold each of the 40 prompts exactly once (0 lost, 0
repeated). Rows: train rank × {sigkill, exit, segfault, deadlock} × {train_step, weight_sync, save};
RolloutManager × the same faults × {rollout, weight_sync, save} (it runs nothing during a synchronous train step);
PPO's critic rank × the same faults × {train_step, save} (the same job with `--advantage-estimator ppo`); the
engine and the router × the same faults × {rollout} (delivered as signals: `faults.signal_fault`).

    .venv/bin/python -m bench.faults --reps 2            # every row, about 1 min per repetition on 2 cores
    .venv/bin/python -m bench.faults --reps 1 --kinds train --faults sigkill
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sim.fault_job import fault_env, job_flags, lineage, prepare_assets, restarts
from sim.slime_run import run_slime_train

ROOT = Path(__file__).resolve().parents[1]
FAULTS = ("sigkill", "exit", "segfault", "deadlock")
# which points each kind reaches, and the how-manieth time to fault there: after rollout 0's checkpoint, so a
# restart has something to resume from and something after it to redo (weight sync: the start-up sync is the 1st)
POINTS = {
    "train": {"train_step": 2, "weight_sync": 3, "save": 2},
    "rollout_manager": {"rollout": 2, "weight_sync": 3, "save": 2},
    "critic": {"train_step": 2, "save": 2},  # PPO's critic; it receives no weight sync
    # processes that run no slime code: the RolloutManager signals them at the 2nd rollout's start
    "engine": {"rollout": 2},
    "router": {"rollout": 2},
}
TIMEOUT_S = 600


def run_once(assets: Path, work: Path, kind: str, fault: str, point: str, nth: int, max_restarts: int) -> dict:
    run = work / "run"
    marker = work / "fired.json"
    spec = f"{kind}:{fault}:{point}:{nth}"
    t0 = time.monotonic()
    argv = job_flags(assets, run, max_restarts=max_restarts, ppo=kind == "critic")
    rc = run_slime_train(argv, work / "driver.log", TIMEOUT_S, env=fault_env(spec, marker))
    out: dict[str, Any] = {"spec": spec, "rc": rc, "fired": marker.exists(), "wall_s": round(time.monotonic() - t0, 1)}
    out.update(lineage(run))
    record = restarts(run)
    out["restarts"] = record["restarts"] if record else 0
    out["faults_seen"] = [a["fault"] for a in record["attempts"] if a["fault"]] if record else []
    out["survived"] = bool(
        rc == 0
        and out["fired"]
        and out["lost"] == 0
        and out["repeated"] == 0
        and out["unexpected"] == 0
        and out["rollouts_trained"] == [0, 1, 2, 3]
        and out["samples_trained"] == 40
    )
    if not out["survived"]:
        out["driver_log_tail"] = (work / "driver.log").read_text(errors="replace")[-3000:]
    return out


def table(rows: list[dict]) -> str:
    lines = [
        "| actor | fault | point | survived | restarted | lost prompts | repeated prompts |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        reps = r["reps"]
        lines.append(
            f"| {r['kind']} | {r['fault']} | {r['point']} | {sum(x['survived'] for x in reps)}/{len(reps)} | "
            f"{sum(x['restarts'] > 0 for x in reps)}/{len(reps)} | {sum(x['lost'] for x in reps)} | "
            f"{sum(x['repeated'] for x in reps)} |"
        )
    return "\n".join(lines)


def _write(out: Path, command: str, started: str, max_restarts: int, rows: list[dict]) -> None:
    result = {
        "command": command,
        "started": started,
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "max_restarts": max_restarts,
        "rows": rows,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=2, help="repetitions per row")
    p.add_argument("--kinds", nargs="+", default=list(POINTS), choices=list(POINTS))
    p.add_argument("--faults", nargs="+", default=list(FAULTS), choices=list(FAULTS))
    p.add_argument("--points", nargs="+", default=None, help="only these points")
    p.add_argument("--max-restarts", type=int, default=2)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "faults.json")
    args = p.parse_args(argv)
    rows: list[dict] = []
    started = datetime.now(UTC).isoformat(timespec="seconds")
    command = "python -m bench.faults " + " ".join(sys.argv[1:] if argv is None else argv)
    with tempfile.TemporaryDirectory(prefix="slime-faults-") as tmp:
        assets = prepare_assets(Path(tmp) / "assets")
        for kind in args.kinds:
            for fault in args.faults:
                for point, nth in POINTS[kind].items():
                    if args.points and point not in args.points:
                        continue
                    reps = []
                    for i in range(args.reps):
                        work = Path(tmp) / f"{kind}-{fault}-{point}-{i}"
                        work.mkdir()
                        reps.append(run_once(assets, work, kind, fault, point, nth, args.max_restarts))
                        r = reps[-1]
                        print(
                            f"{r['spec']} rep {i}: survived={r['survived']} rc={r['rc']} fired={r['fired']} "
                            f"restarts={r['restarts']} lost={r['lost']} repeated={r['repeated']} {r['wall_s']} s",
                            flush=True,
                        )
                    rows.append({"kind": kind, "fault": fault, "point": point, "nth": nth, "reps": reps})
                    _write(args.out, command, started, args.max_restarts, rows)  # a stopped run keeps its rows
    print(table(rows))
    print(f"wrote {args.out}")
    return 0 if all(x["survived"] for r in rows for x in r["reps"]) else 1


if __name__ == "__main__":
    sys.exit(main())
