"""Issue #20 acceptance, "OPD raises held-out reward": a weak student distilled on-policy towards a stronger teacher.

    .venv/bin/python -m bench.toy_opd [--out runs/toy_opd] [--megatron] [--smoke] [quick-start flags]

1. **One SFT run** of the quick start's recipe (`examples/toy/quickstart.py`, `--debug-train-only`, `sft_loss`)
   saving an HF checkpoint every `--student-steps` steps: the checkpoint after `--student-steps` is the weak
   **student**, the one after `--teacher-steps` the stronger **teacher** (the same recipe run longer).
2. **A topology** (`--sglang-config`, written to OUT/topology.yaml): `actor` (2 fake `hf` engines, the student,
   receives weights) and `teacher` (1 fake `hf` engine serving the teacher checkpoint, never synced).
3. **Arms**, all the quick start's GRPO job from the student with that same topology, seed and step count:
   - `control`: GRPO on the toy reward alone (the teacher engine is served but never asked);
   - `opd_sglang`: the same plus `--use-opd --opd-type sglang --opd-teacher-models teacher` (teacher log-probs
     of every response token scored by the teacher engine, carried through the train data);
   - `opd_megatron` (with `--megatron`): the same plus `--use-opd --opd-type megatron --opd-teacher-load TEACHER`
     (the teacher forwarded on the trainer from a pinned host copy);
   - `teacher`: `--num-rollout 0` from the teacher checkpoint, i.e. only its held-out eval (the target to move to).

Eval: the quick start's (128 held-out prompts × 4, T = 1, `--eval-fixed-sampling-seed`), every `--eval-interval`
steps, so step 0 is the same number in every student arm and curves differ only where the weights did.
Prints a table (step × held-out reward per arm) and ratios, writes `--out-json` and `--png`. A bench, not a
test: it never asserts (`--smoke` is the wiring check `tests/integration/test_toy_opd_bench.py` runs). Results:
docs/performance.md, "Toy task: on-policy distillation".
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import logging
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from bench.toy_learning import eval_curve, read_metrics, run_side_by_side
from examples.toy import quickstart

ROOT = Path(__file__).resolve().parents[1]
logger = logging.getLogger("bench.toy_opd")
TEACHER_MODEL = "teacher"  # the model name of the topology that serves the teacher checkpoint
STUDENT_ARMS = ("control", "opd_sglang", "opd_megatron")


def topology_yaml(teacher: Path) -> str:
    """The actor (2 engines, synced) and the teacher (1 engine, frozen) of every student arm: 3 fake GPUs."""
    return (
        "sglang:\n"
        "  - name: actor\n    update_weights: true\n    server_groups:\n      - num_gpus: 2\n"
        f"  - name: {TEACHER_MODEL}\n    model_path: {teacher}\n    update_weights: false\n"
        "    server_groups:\n      - num_gpus: 1\n"
    )


def arm_flags(a: argparse.Namespace, paths: dict[str, Path], student: Path, teacher: Path, topo: Path) -> dict:
    """name -> `slime train` flags; only the OPD flags differ between the student arms."""
    base = [*quickstart.grpo_flags(a, paths, student), "--sglang-config", str(topo), "--rollout-num-gpus", "3"]
    opd = ["--use-opd", "--opd-kl-coef", str(a.opd_kl_coef)]
    arms = {
        "control": base,
        "opd_sglang": [*base, *opd, "--opd-type", "sglang", "--opd-teacher-models", TEACHER_MODEL],
    }
    if a.megatron:
        arms["opd_megatron"] = [*base, *opd, "--opd-type", "megatron", "--opd-teacher-load", str(teacher)]
    # The teacher's own held-out reward: the same eval, no training step (the loop evaluates once and stops).
    only_eval = copy.copy(a)
    only_eval.rl_max_steps = 0
    arms["teacher"] = quickstart.grpo_flags(only_eval, paths, teacher)
    return arms


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    # allow_abbrev off: the quick start's --out must not be taken for an abbreviation of --out-json
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--student-steps", type=int, default=40, help="SFT steps of the weak student")
    p.add_argument("--teacher-steps", type=int, default=160, help="SFT steps of the teacher (same run, longer)")
    p.add_argument("--opd-kl-coef", type=float, default=1.0)
    p.add_argument("--megatron", action="store_true", help="also the --opd-type megatron arm")
    p.add_argument("--parallel", action=argparse.BooleanOptionalAction, default=True, help="arms side by side")
    p.add_argument("--out-json", default=None, help="default bench/results/toy_opd.json (smoke: OUT/toy_opd.json)")
    p.add_argument("--png", default=None, help="default docs/img/toy_opd.png (smoke: OUT/toy_opd.png)")
    mine, rest = p.parse_known_args(argv)
    defaults = ["--out", "runs/toy_opd", "--rl-max-steps", "20", "--eval-interval", "4"]
    a, extra = quickstart.parse_args([*defaults, *rest])
    for k, v in vars(mine).items():
        setattr(a, k, v)
    if a.smoke:  # wiring only: a few steps of everything, tiny batches
        a.student_steps, a.teacher_steps, a.rl_max_steps, a.eval_interval = 2, 4, 2, 1
        a.prompts, a.samples, a.num_train = 8, 4, 64
    smoke_out = Path(a.out) if os.path.isabs(a.out) else ROOT / a.out
    a.out_json = a.out_json or str(smoke_out / "toy_opd.json" if a.smoke else ROOT / "bench/results/toy_opd.json")
    a.png = a.png or str(smoke_out / "toy_opd.png" if a.smoke else ROOT / "docs/img/toy_opd.png")
    if a.teacher_steps <= a.student_steps:
        p.error("--teacher-steps must exceed --student-steps (the teacher is the same SFT run, longer)")
    return a, extra


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a, extra = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    from examples.toy.prepare import prepare

    out = (ROOT / a.out).resolve() if not os.path.isabs(a.out) else Path(a.out)
    os.environ.setdefault("SLIME_CPU_THREADS", str(os.cpu_count() or 1))
    # the runs import this checkout's slime even where the environment has another one installed
    os.environ["PYTHONPATH"] = os.pathsep.join(x for x in (str(ROOT), os.environ.get("PYTHONPATH")) if x)
    t_all = time.perf_counter()
    paths = prepare(
        out / "assets",
        num_train=a.num_train,
        num_eval=8 if a.smoke else 128,
        model_kwargs=None if a.smoke else quickstart.MODEL,
    )
    res: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}",
        "argv": sys.argv[1:] if argv is None else argv,
        "smoke": a.smoke,
        "recipe": {k: getattr(a, k) for k in ("student_steps", "teacher_steps", "sft_lr", "rl_lr", "rl_max_steps",
                                               "prompts", "samples", "eval_interval", "opd_kl_coef", "seed")},
    }  # fmt: skip

    # ---- 1. one SFT run: the student early, the teacher late ---------------------------------------------
    sft = copy.copy(a)
    sft.sft_steps = a.teacher_steps
    sft_dir = out / "sft"
    flags = [*quickstart.sft_flags(sft, paths, sft_dir / "hf_{rollout_id}"), "--save-interval", str(a.student_steps)]
    logger.info("SFT %d steps (student after %d, teacher after %d)", a.teacher_steps, a.student_steps, a.teacher_steps)
    res["sft_wall_s"] = run_side_by_side({"sft": (flags, sft_dir, None)})["sft"]["wall_s"]
    student, teacher = sft_dir / f"hf_{a.student_steps - 1}", sft_dir / f"hf_{a.teacher_steps - 1}"
    topo = out / "topology.yaml"
    topo.write_text(topology_yaml(teacher))
    res["checkpoints"] = {"student": str(student), "teacher": str(teacher)}

    # ---- 2. the arms -----------------------------------------------------------------------------------
    arms = {name: ([*f, *extra], out / name, None) for name, f in arm_flags(a, paths, student, teacher, topo).items()}
    walls: dict[str, Any] = {}
    if a.parallel:
        # independent runs on the same fake topology; steps, not seconds, are the x axis, so sharing cores
        # changes wall times only (the trainers split the cores between them)
        logger.info("arms side by side: %s (%d GRPO steps each)", ", ".join(arms), a.rl_max_steps)
        threads = str(max(1, int(os.environ["SLIME_CPU_THREADS"]) // 2))
        walls = run_side_by_side(arms, env={"SLIME_CPU_THREADS": threads})
    else:
        for name, job in arms.items():
            logger.info("arm %s (%d GRPO steps)", name, a.rl_max_steps)
            walls.update(run_side_by_side({name: job}))
    res["arms"] = {name: {"wall_s": w["wall_s"], "command": (out / name / "command.txt").read_text().strip()}
                   for name, w in walls.items()}  # fmt: skip
    res["total_wall_s"] = round(time.perf_counter() - t_all, 1)
    return finish(a, out, res)


def analyse(out: Path, res: dict[str, Any]) -> dict[str, Any]:
    """Curves, the OPD metric and the ratios, from the arms' metrics.jsonl."""
    for name, arm in res["arms"].items():
        arm["curve"] = eval_curve(out / name)
        train = read_metrics(out / name / "metrics.jsonl", "train")
        arm["opd_reverse_kl"] = [(r["step"], r["metrics"]["train/opd_reverse_kl"]) for r in train
                                 if "train/opd_reverse_kl" in r["metrics"]]  # fmt: skip
    teacher = res["arms"]["teacher"]["curve"]
    res["teacher_eval"] = teacher[0][1] if teacher else None
    ctl = res["arms"]["control"]["curve"]
    res["student_eval"] = ctl[0][1] if ctl else None
    summary: dict[str, Any] = {}
    for name in STUDENT_ARMS:
        if name not in res["arms"] or not res["arms"][name]["curve"]:
            continue
        curve = res["arms"][name]["curve"]
        vals = [v for _, v in curve]
        summary[name] = {"start": vals[0], "final": vals[-1], "best": max(vals), "gain": round(vals[-1] - vals[0], 4),
                         "mean_after_start": round(sum(vals[1:]) / max(1, len(vals) - 1), 4)}  # fmt: skip
        if res["teacher_eval"] is not None and res["teacher_eval"] != vals[0]:
            # how much of the student→teacher gap the arm closed
            summary[name]["gap_closed"] = round((vals[-1] - vals[0]) / (res["teacher_eval"] - vals[0]), 3)
    c = summary.get("control", {})
    for name in ("opd_sglang", "opd_megatron"):
        if name in summary and c:
            s = summary[name]
            s["gain_over_control_gain"] = round(s["gain"] / c["gain"], 3) if c["gain"] else None
            s["final_minus_control"] = round(s["final"] - c["final"], 4)
            ctl_by_step = dict(res["arms"]["control"]["curve"])
            s["steps_above_control"] = sum(v > ctl_by_step[t] for t, v in res["arms"][name]["curve"][1:]
                                           if t in ctl_by_step)  # fmt: skip
    res["summary"] = summary
    return res


def finish(a: argparse.Namespace, out: Path, res: dict[str, Any]) -> dict[str, Any]:
    res = analyse(out, res)
    dest = Path(a.out_json)
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(res, indent=1) + "\n")
    print_table(res)  # the table first: a plotting failure must not hide the result
    try:
        plot(Path(a.png), res)
    except ImportError as e:
        logger.warning("%s not drawn (%s)", a.png, e)
    logger.info("wrote %s", dest)
    return res


def print_table(res: dict[str, Any]) -> None:
    names = [n for n in STUDENT_ARMS if n in res["arms"]]
    curves = {n: dict(res["arms"][n]["curve"]) for n in names}
    steps = sorted({s for c in curves.values() for s in c})
    print(f"\nstudent (SFT {res['recipe']['student_steps']} steps) held-out {res['student_eval']}; "
          f"teacher (SFT {res['recipe']['teacher_steps']} steps) held-out {res['teacher_eval']}")  # fmt: skip
    print(f"{'step':>5} " + " ".join(f"{n:>13}" for n in names))
    for s in steps:
        print(f"{s:>5} " + " ".join(f"{curves[n].get(s, float('nan')):>13.3f}" for n in names))
    for name, s in res["summary"].items():
        extra = "".join(f", {k} {s[k]}" for k in ("gap_closed", "gain_over_control_gain", "final_minus_control",
                                                   "steps_above_control") if k in s)  # fmt: skip
        kl = res["arms"][name]["opd_reverse_kl"]
        kl_text = f", opd_reverse_kl {kl[0][1]:.3f} → {kl[-1][1]:.3f}" if kl else ""
        print(f"{name}: {s['start']:.3f} → {s['final']:.3f} (gain {s['gain']:+.3f}){extra}{kl_text}")
    print(f"total wall time {res['total_wall_s']:.0f} s (SFT {res['sft_wall_s']:.0f} s)")


def plot(path: Path, res: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    styles = {"control": ("tab:gray", "control: GRPO, no OPD"), "opd_sglang": ("tab:blue", "GRPO + OPD, sglang"),
              "opd_megatron": ("tab:purple", "GRPO + OPD, megatron")}  # fmt: skip
    for name, (color, label) in styles.items():
        curve = res["arms"].get(name, {}).get("curve")
        if curve:
            ax.plot([s for s, _ in curve], [v for _, v in curve], "o-", ms=4, color=color, label=label)
    if res["teacher_eval"] is not None:
        ax.axhline(res["teacher_eval"], color="tab:green", ls=":", label=f"teacher {res['teacher_eval']:.3f}")
    r = res["recipe"]
    ax.set_xlabel(f"GRPO step from the student (SFT {r['student_steps']} steps; teacher: SFT {r['teacher_steps']})")
    ax.set_ylabel("reward on held-out prompts (T = 1)")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"toy task: on-policy distillation (--opd-kl-coef {r['opd_kl_coef']}) vs GRPO alone")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
