"""PPO learns the toy task: the GRPO bench's SFT checkpoint, then PPO (critic on the actor's GPU) against `--lr 0`.

    .venv/bin/python -m bench.ppo_learning [--workdir runs/ppo_learning] [--max-steps 150] [...]
    .venv/bin/python -m bench.ppo_learning --reanalyse   # rebuild JSON/PNG/table from the workdir only

Same task, model, data, SFT warm-up (stopped at the first eval in [0.5, 0.6]) and RL recipe as
`bench/toy_learning.py` — 256 prompts × 8 samples per step, `--rollout-temperature 1`, low_var_kl loss 0.2 to the
start, Adam ε 1e-3, `--clip-grad 0.2`, per-token loss, the engine's log-probs as π_old — with
`--advantage-estimator ppo` instead of `grpo`: GAE over the critic's values (γ, λ below), advantages whitened over
the step (`--normalize-advantages`, the role GRPO's std division plays), a critic started from the same SFT
checkpoint with a fresh value head, trained first alone for `--critic-only-steps` rollouts, with its own learning
rate, Adam ε and clip through `--megatron-config`. The control runs the same number of steps with the actor's
`--lr 0` (the critic still learns; the policy must not move). Eval: 8 samples per held-out prompt at T = 1 with
fixed sampling seeds, every 5 steps.

Writes `--out-json`, draws `--png` beside GRPO's recorded curve (`bench/results/toy_learning.json`), prints a table.
A bench, not a test: it never asserts. Results: docs/performance.md, "PPO on the toy task".
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

from bench.toy_learning import (
    common_flags,
    eval_curve,
    first_at_or_after,
    rl_flags,
    run_slime,
)
from bench.toy_learning import parse_args as toy_parse_args

ROOT = Path(__file__).resolve().parents[1]
logger = logging.getLogger("bench.ppo_learning")


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, argparse.Namespace]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workdir", default="runs/ppo_learning")
    p.add_argument("--out-json", default="bench/results/ppo_learning.json")
    p.add_argument("--png", default="docs/img/ppo_learning.png")
    p.add_argument("--grpo-json", default="bench/results/toy_learning.json", help="GRPO's recording, for the plot")
    p.add_argument("--sft-checkpoint", default=None, help="skip the SFT warm-up and start from this HF dir")
    p.add_argument("--max-steps", type=int, default=150)
    p.add_argument("--target", type=float, default=0.9)
    p.add_argument("--gamma", type=float, default=1.0)
    p.add_argument("--lambd", type=float, default=0.95)
    p.add_argument("--critic-only-steps", type=int, default=3)
    p.add_argument("--critic-lr", type=float, default=1e-3)
    p.add_argument("--critic-adam-eps", type=float, default=1e-8)
    p.add_argument("--critic-clip-grad", type=float, default=1.0)
    p.add_argument("--skip-control", action="store_true")
    p.add_argument("--reanalyse", action="store_true")
    a, rest = p.parse_known_args(argv)
    return a, toy_parse_args([*rest, "--workdir", a.workdir])  # the task, model and RL recipe of the GRPO bench


def ppo_flags(a: argparse.Namespace, toy: argparse.Namespace, ckpt: Path, paths: dict, steps: int, roles: Path) -> list[str]:  # fmt: skip
    flags = rl_flags(toy, ckpt, paths["train"], steps)
    flags[flags.index("--advantage-estimator") + 1] = "ppo"
    return [
        *flags, "--normalize-advantages", "--gamma", str(a.gamma), "--lambd", str(a.lambd),
        "--num-critic-only-steps", str(a.critic_only_steps), "--megatron-config", str(roles),
        "--custom-rm-path", "examples.toy.reward.reverse_digits_rm", "--eval-prompt-data", "toy", str(paths["eval"]),
    ]  # fmt: skip


def sft(toy: argparse.Namespace, paths: dict, work: Path) -> tuple[Path, dict]:
    """The GRPO bench's warm-up, stopped at the first eval in its band; returns the chosen HF checkpoint."""
    lo, hi = toy.band
    flags = [
        *common_flags(toy, paths["model"], paths["train"]),
        "--rollout-function-path", "slime.rollout.sft_rollout.generate_rollout",
        "--eval-function-path", "slime.rollout.sglang_rollout.generate_rollout",
        "--eval-prompt-data", "toy", str(paths["eval"]), "--eval-interval", str(toy.sft_eval_interval),
        "--n-samples-per-eval-prompt", str(toy.sft_eval_samples_per_prompt),
        "--custom-rm-path", "examples.toy.reward.reverse_digits_rm", "--loss-type", "sft_loss",
        "--rollout-batch-size", str(toy.sft_batch), "--global-batch-size", str(toy.sft_batch),
        "--num-rollout", str(toy.sft_max_steps), "--lr", str(toy.sft_lr),
        "--save-hf", str(work / "sft" / "hf_{rollout_id}"), "--save-interval", str(toy.sft_eval_interval),
    ]  # fmt: skip
    run = run_slime(flags, work / "sft", stop=lambda c: first_at_or_after(c, lambda v: lo <= v <= hi) is not None)
    curve = eval_curve(work / "sft")
    chosen = first_at_or_after(curve, lambda v: lo <= v <= hi)
    if chosen is None:
        raise SystemExit(f"SFT never evaluated inside {toy.band}: {curve}")
    return work / "sft" / f"hf_{chosen - 1}", {**run, "chosen_step": chosen, "chosen_eval": dict(curve)[chosen]}


def analyse(a: argparse.Namespace, res: dict[str, Any]) -> dict[str, Any]:
    work = (ROOT / a.workdir).resolve()
    for key in ("ppo", "lr0"):
        if key in res["rl"]:
            res["rl"][key]["curve"] = eval_curve(work / key)
    ppo = res["rl"]["ppo"]
    first = first_at_or_after(ppo["curve"], lambda v: v >= a.target)
    ppo["first_step_at_target"] = first
    ppo["curve_after_stop"] = [c for c in ppo["curve"] if first is not None and c[0] > first]
    ppo["curve"] = [c for c in ppo["curve"] if first is None or c[0] <= first]
    start = ppo["curve"][0][1] if ppo["curve"] else None
    res["start_eval"] = start
    ppo["best"] = max((v for _, v in ppo["curve"]), default=None)
    if "lr0" in res["rl"] and res["rl"]["lr0"]["curve"] and start is not None:
        dev = [abs(v - start) for _, v in res["rl"]["lr0"]["curve"]]
        res["rl"]["lr0"]["max_abs_deviation"] = round(max(dev), 4)
    grpo = ROOT / a.grpo_json
    if grpo.is_file():
        g = json.loads(grpo.read_text())
        res["grpo_recorded"] = {"curve": g["rl"]["grpo"]["curve"], "wall_to_stop_s": g["rl"]["grpo"].get("wall_to_stop_s")}  # fmt: skip
    res["verdict"] = {
        "ppo_reaches_0.85": ppo["best"] is not None and ppo["best"] >= 0.85,
        "ppo_reaches_target": first is not None,
        "lr0_flat_within_0.05": res["rl"].get("lr0", {}).get("max_abs_deviation", 1.0) <= 0.05,
    }
    return res


def plot(path: Path, res: dict[str, Any], target: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    series = [("ppo", "tab:blue", "PPO (critic on the actor's GPU)"), ("lr0", "tab:orange", "control: actor --lr 0")]
    for key, color, label in series:
        c = res["rl"].get(key, {}).get("curve")
        if c:
            ax.plot([s for s, _ in c], [v for _, v in c], "o-", ms=3, color=color, label=label)
    g = res.get("grpo_recorded", {}).get("curve")
    if g:
        ax.plot(
            [s for s, _ in g], [v for _, v in g], "--", color="tab:gray", label="GRPO (recorded, bench.toy_learning)"
        )
    ax.axhline(target, color="tab:green", ls=":", lw=1, label=f"target {target}")
    ax.set_xlabel("RL step from the SFT checkpoint")
    ax.set_ylabel("held-out eval reward (T = 1, 2048 samples)")
    ax.set_ylim(0, 1.02)
    ax.set_title("Toy task: PPO vs GRPO from the same SFT checkpoint")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def finish(a: argparse.Namespace, res: dict[str, Any]) -> dict[str, Any]:
    res = analyse(a, res)
    out = ROOT / a.out_json
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n")
    plot(ROOT / a.png, res, a.target)
    print(f"{'run':<6} {'steps':>5} {'start':>6} {'final':>6} {'best':>6} {'wall s':>7}")
    for key in ("ppo", "lr0"):
        r = res["rl"].get(key)
        if r and r["curve"]:
            vals = [v for _, v in r["curve"]]
            print(f"{key:<6} {r['curve'][-1][0]:>5} {vals[0]:>6.3f} {vals[-1]:>6.3f} {max(vals):>6.3f} "
                  f"{r.get('wall_to_stop_s') or r['wall_s']:>7.0f}")  # fmt: skip
    print(f"PPO first eval >= {a.target}: step {res['rl']['ppo']['first_step_at_target']}; verdict {res['verdict']}")
    return res


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a, toy = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if a.reanalyse:
        return finish(a, json.loads((ROOT / a.out_json).read_text()))
    from examples.toy.prepare import prepare

    work = (ROOT / a.workdir).resolve()
    os.environ.setdefault("SLIME_CPU_THREADS", str(os.cpu_count() or 1))
    t_all = time.perf_counter()
    model_kwargs = {k: getattr(toy, k) for k in ("hidden_size", "num_layers", "num_heads", "num_kv_heads")}
    model_kwargs["intermediate_size"] = toy.intermediate_size
    paths = prepare(work / "assets", toy.num_train, toy.num_eval, toy.data_seed, model_kwargs=model_kwargs)
    res: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}",
        "argv": sys.argv[1:] if argv is None else argv,
        "model": model_kwargs,
        "target": a.target,
        "ppo": {
            "gamma": a.gamma,
            "lambd": a.lambd,
            "critic_only_steps": a.critic_only_steps,
            "critic_lr": a.critic_lr,
            "critic_adam_eps": a.critic_adam_eps,
            "critic_clip_grad": a.critic_clip_grad,
        },  # fmt: skip
        "rl": {},
    }
    if a.sft_checkpoint:
        ckpt = Path(a.sft_checkpoint).resolve()
        res["sft"] = {"checkpoint": str(ckpt), "reused": True}
    else:
        logger.info("SFT warm-up (the GRPO bench's)")
        ckpt, res["sft"] = sft(toy, paths, work)
        res["sft"]["checkpoint"] = str(ckpt)
    roles = work / "roles.yaml"
    roles.write_text(
        "megatron:\n  - name: default\n    role: critic\n    overrides:\n"
        f"      lr: {a.critic_lr}\n      adam_eps: {a.critic_adam_eps}\n      clip_grad: {a.critic_clip_grad}\n"
        "      lr_warmup_iters: 0\n"
    )
    reached = lambda c: first_at_or_after(c, lambda v: v >= a.target) is not None  # noqa: E731
    logger.info("PPO from %s (at most %d steps)", ckpt, a.max_steps)
    flags = [*ppo_flags(a, toy, ckpt, paths, a.max_steps, roles), "--lr", str(toy.rl_lr)]
    res["rl"]["ppo"] = run_slime(flags, work / "ppo", stop=reached)
    curve = eval_curve(work / "ppo")
    first = first_at_or_after(curve, lambda v: v >= a.target)
    steps = first if first is not None else max((s for s, _ in curve), default=a.max_steps)
    if not a.skip_control:
        logger.info("control: actor --lr 0 for %d steps", steps)
        res["rl"]["lr0"] = run_slime([*ppo_flags(a, toy, ckpt, paths, steps, roles), "--lr", "0"], work / "lr0", None)
    res["total_wall_s"] = round(time.perf_counter() - t_all, 1)
    return finish(a, res)


if __name__ == "__main__":
    main()
