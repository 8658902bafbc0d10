"""Issue #4 acceptance, "it learns by RL": SFT warm-up → GRPO on the toy task, against two controls.

    .venv/bin/python -m bench.toy_learning [--workdir runs/toy_learning] [--rl-max-steps 120] [...]
    .venv/bin/python -m bench.toy_learning --reanalyse   # rebuild JSON/PNG/table from the workdir only

Every phase is the real `slime train` CLI (megatron-core on CPU through the shim, fake `hf` engines behind the
real router, weight sync after every rollout), run as a subprocess whose `metrics.jsonl` is watched:

1. **SFT** (`--loss-type sft_loss`, labels as responses) from the random-init checkpoint, held-out eval and an
   HF checkpoint every `--sft-eval-interval` steps; stopped at the first eval inside `--band` (default
   [0.5, 0.6]), whose checkpoint is the RL start.
2. **GRPO** from that checkpoint (`--n-samples-per-prompt`, `--rollout-temperature 1.0`, a low_var_kl loss to the
   checkpoint: without it the random-reward control collapses; Adam ε 1e-3, `--clip-grad 0.2` and
   `--calculate-per-token-loss`: without them it makes rare, abrupt excursions; 256 prompts per step: half the
   steps of 64, so the random control has half as long to drift; lr 1.5e-3: a quarter fewer steps than 1e-3 at
   the same drift — docs/performance.md),
   stopped at the first eval ≥ `--target` (or after `--rl-max-steps`).
3. **Controls** for the same number of steps from the same checkpoint, side by side (`--parallel-controls`),
   identical flags except: `--lr 0`;
   `--rm-type random` (no `--custom-rm-path`: its eval rows are scored by `bench/toy_reward_server.py` through
   `remote_rm`, so every run reports the same toy reward).

Eval is always at temperature 1.0 on the held-out prompts, with `--eval-fixed-sampling-seed`: every eval of every
run draws the same sampling seeds, so step 0 is the same number in all three RL runs and a curve moves only where
the weights changed (an unchanged model repeats its eval exactly).

Writes `--out-json` (curves, wall times, chosen checkpoint, verdicts), draws `--png` (matplotlib), prints a
table. A bench, not a test: it never asserts; on 2 shared cores wall times are indicative. Results and their
reading: docs/performance.md, "Toy task learning (issue #4)".
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
logger = logging.getLogger("bench.toy_learning")
RM_KEY = "bench_rm"  # metadata key only the random control reads (see bench/toy_reward_server.py)


def read_metrics(path: Path, kind: str) -> list[dict[str, Any]]:
    """Records of one kind from a metrics.jsonl that may still be being written (a torn last line is skipped)."""
    out = []
    if not path.is_file():
        return out
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if rec.get("kind") == kind:
            out.append(rec)
    return out


def eval_curve(metrics_dir: Path, name: str = "toy") -> list[tuple[int, float]]:
    key = f"eval/{name}"
    return [(r["step"], float(r["metrics"][key])) for r in read_metrics(metrics_dir / "metrics.jsonl", "eval")]


def _launch(flags: list[str], metrics_dir: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start `slime train FLAGS` in its own session, logging to `metrics_dir/train.log` (from the main thread)."""
    metrics_dir.mkdir(parents=True, exist_ok=True)
    (metrics_dir / "metrics.jsonl").unlink(missing_ok=True)
    cmd = [str(ROOT / ".venv" / "bin" / "slime"), "train", *flags, "--metrics-dir", str(metrics_dir)]
    if not Path(cmd[0]).exists():
        cmd[0:1] = [sys.executable, "-m", "slime.cli"]
    (metrics_dir / "command.txt").write_text(" ".join(cmd) + "\n")
    with open(metrics_dir / "train.log", "w") as log:
        return subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_default_sigint,
            env={**os.environ, **(env or {})},
        )


def run_slime(flags: list[str], metrics_dir: Path, stop: Callable[[list[tuple[int, float]]], bool] | None) -> dict:
    """Run `slime train FLAGS`, stopped (see `_stop_group`) once `stop(eval_curve)` holds; returns wall times."""
    return run_side_by_side({"run": (flags, metrics_dir, stop)})["run"]


def run_side_by_side(
    jobs: dict[str, tuple[list[str], Path, Callable[[list[tuple[int, float]]], bool] | None]],
    env: dict[str, str] | None = None,
) -> dict[str, dict]:
    """Run several `slime train`s at once (name -> flags, metrics dir, stop condition); wall times per name."""
    t0 = time.perf_counter()
    procs = {name: _launch(flags, d, env) for name, (flags, d, _) in jobs.items()}
    stop_s: dict[str, float] = {}
    walls: dict[str, float] = {}
    try:
        while len(walls) < len(procs):
            time.sleep(1.0)
            for name, proc in procs.items():
                if name in walls:
                    continue
                _, d, stop = jobs[name]
                if proc.poll() is not None:
                    walls[name] = time.perf_counter() - t0
                elif stop is not None and name not in stop_s and stop(eval_curve(d)):
                    stop_s[name] = time.perf_counter() - t0
                    _stop_group(proc)
    except BaseException:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        raise
    out = {}
    for name, proc in procs.items():
        stopped_early = name in stop_s
        if proc.returncode != 0 and not stopped_early:
            raise RuntimeError(f"slime train failed (rc={proc.returncode}); see {jobs[name][1] / 'train.log'}")
        out[name] = {"wall_s": round(walls[name], 1), "stopped_early": stopped_early, "returncode": proc.returncode}
        if stopped_early:
            out[name]["wall_to_stop_s"] = round(stop_s[name], 1)  # when the condition held; the rest is shutdown
    return out


def _default_sigint() -> None:
    # A bench started in the background (`cmd &` without job control) inherits SIGINT as ignored, and so would
    # `slime train`; Python only turns SIGINT into KeyboardInterrupt when it starts with the default handler.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGINT the driver (its `finally` disposes engines and Ray); escalate to the whole process group.

    Should the driver not be done after a short grace, the group
    (the driver and the Ray head processes it started; engines follow through their parent-death signal)
    gets SIGTERM, then SIGKILL. The group is this bench's own child session (start_new_session=True).
    """
    for sig, grace in ((signal.SIGINT, 20), (signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        try:
            if sig == signal.SIGINT:
                proc.send_signal(sig)
            else:
                os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            logger.warning("slime train still running %d s after %s", grace, signal.Signals(sig).name)


def common_flags(a: argparse.Namespace, checkpoint: Path, train: Path) -> list[str]:
    return [
        "--hf-checkpoint", str(checkpoint), "--prompt-data", str(train),
        "--input-key", "input", "--label-key", "label", "--apply-chat-template", "--rollout-shuffle",
        "--rollout-max-response-len", "12", "--rollout-temperature", "1.0", "--eval-temperature", "1.0",
        "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1",
        "--rollout-num-gpus", str(a.rollout_num_gpus), "--rollout-num-gpus-per-engine", "1",
        "--rollout-engine", "sim", "--sim-engine", "hf",
        "--custom-megatron-init-path", "sim.fake_megatron.cpu_shim.apply",
        "--use-dynamic-batch-size", "--max-tokens-per-gpu", str(a.max_tokens_per_gpu),
        "--seed", str(a.seed), "--no-use-tensorboard", "--eval-fixed-sampling-seed",
        "--sglang-max-running-requests", str(a.max_running_requests),
    ]  # fmt: skip


def rl_flags(a: argparse.Namespace, checkpoint: Path, train: Path, num_rollout: int) -> list[str]:
    flags = [
        *common_flags(a, checkpoint, train),
        "--rollout-batch-size", str(a.rl_batch), "--n-samples-per-prompt", str(a.n_samples),
        "--global-batch-size", str(a.rl_batch * a.n_samples), "--num-rollout", str(num_rollout),
        "--eval-interval", str(a.rl_eval_interval), "--advantage-estimator", "grpo",
        "--n-samples-per-eval-prompt", str(a.n_samples_per_eval_prompt),
        "--adam-eps", str(a.rl_adam_eps), "--lr-warmup-iters", str(a.rl_lr_warmup), "--clip-grad", str(a.rl_clip_grad),
    ]  # fmt: skip
    if a.rl_per_token_loss:
        flags.append("--calculate-per-token-loss")
    if a.kl_loss_coef:
        flags += ["--use-kl-loss", "--kl-loss-coef", str(a.kl_loss_coef), "--kl-loss-type", "low_var_kl"]
    if not a.rl_recompute_logprobs:
        flags.append("--use-rollout-logprobs")
    return flags


def first_at_or_after(curve: list[tuple[int, float]], pred: Callable[[float], bool], after: int = 1) -> int | None:
    return next((s for s, v in curve if s >= after and pred(v)), None)


def plot(path: Path, res: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s0 = res["sft"]["chosen_step"]
    fig, ax = plt.subplots(figsize=(9, 5))
    sft = [(s, v) for s, v in res["sft"]["curve"] if s <= s0]  # later points: SFT ran on while being stopped
    ax.plot([s for s, _ in sft], [v for _, v in sft], "o-", ms=3, color="tab:gray", label="SFT warm-up (sft_loss)")
    styles = {"grpo": ("tab:blue", "GRPO"), "lr0": ("tab:orange", "control: --lr 0"),
              "random": ("tab:red", "control: --rm-type random")}  # fmt: skip
    for key, (color, label) in styles.items():
        run = res["rl"].get(key)
        if run and run["curve"]:
            ax.plot(
                [s0 + s for s, _ in run["curve"]], [v for _, v in run["curve"]], "o-", ms=3, color=color, label=label
            )
    start = res["rl"]["start_eval"]
    ax.axvline(s0, color="black", ls="--", lw=1)
    ax.text(s0, 1.01, " SFT → RL", va="bottom", ha="left", fontsize=9)
    ax.axhspan(start - res["control_tolerance"], start + res["control_tolerance"], color="tab:green", alpha=0.12,
               label=f"start ±{res['control_tolerance']}")  # fmt: skip
    ax.axhspan(res["band"][0], res["band"][1], xmax=0.015, color="tab:purple", alpha=0.4, label="start band")
    trunc = res["rl"]["grpo"].get("truncated_ratio")
    if trunc:  # the toy reward ignores text after the digits, so not stopping costs nothing: show it
        ax.plot([s0 + s for s, _ in trunc], [v for _, v in trunc], "--", lw=1, color="tab:blue", alpha=0.6,
                label="GRPO: eval answers cut at max length (fraction)")  # fmt: skip
    ax.axhline(res["target"], color="tab:blue", ls=":", lw=1, label=f"target {res['target']}")
    ax.set_xlabel("training step (SFT steps, then RL steps from the chosen checkpoint)")
    ax.set_ylabel(f"held-out eval reward, T=1.0 (SFT {res['sft_eval_samples']}, RL {res['eval_samples']} samples)")
    ax.set_ylim(0, 1.05)
    ax.set_title("Toy task (reverse 6–8 digits): SFT warm-up, then GRPO vs controls")
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workdir", default="runs/toy_learning")
    p.add_argument("--out-json", default="bench/results/toy_learning.json")
    p.add_argument("--png", default="docs/img/toy_learning.png")
    p.add_argument("--seed", type=int, default=1234, help="training seed (megatron init order, shuffling)")
    p.add_argument("--data-seed", type=int, default=0, help="examples.toy.prepare --seed (split and model init)")
    g = p.add_argument_group("task and model")
    g.add_argument("--num-train", type=int, default=4096)
    g.add_argument("--num-eval", type=int, default=256)
    g.add_argument("--hidden-size", type=int, default=128)
    g.add_argument("--num-layers", type=int, default=2)
    g.add_argument("--num-heads", type=int, default=4)
    g.add_argument("--num-kv-heads", type=int, default=2)
    g.add_argument("--intermediate-size", type=int, default=256)
    g = p.add_argument_group("SFT warm-up")
    g.add_argument("--sft-lr", type=float, default=1e-3)
    g.add_argument("--sft-batch", type=int, default=64)
    g.add_argument("--sft-max-steps", type=int, default=500)
    g.add_argument("--sft-eval-interval", type=int, default=5)
    g.add_argument("--band", type=float, nargs=2, default=[0.5, 0.6])
    g.add_argument("--sft-eval-samples-per-prompt", type=int, default=1)
    g = p.add_argument_group("RL (GRPO and the controls)")
    g.add_argument("--rl-lr", type=float, default=1.5e-3, help="reference sweep s12: 0.9 in 60 instead of 80 steps")
    g.add_argument("--rl-adam-eps", type=float, default=1e-3, help="large: parameters with tiny gradients stay put")
    g.add_argument("--rl-clip-grad", type=float, default=0.2, help="below the usual grad norm: bounds every step")
    g.add_argument(
        "--rl-per-token-loss",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="--calculate-per-token-loss: short answers get no larger per-token weight than long ones",
    )
    g.add_argument("--rl-lr-warmup", type=int, default=10, help="--lr-warmup-iters of the RL runs")
    g.add_argument(
        "--rl-recompute-logprobs",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="recompute π_old in the trainer; default: the engine's log-probs (--use-rollout-logprobs), one forward "
        "per step less: weights are synced every step, and the two agree to ~1e-5 (tests/integration/"
        "test_trainer_engine_agreement.py)",
    )
    g.add_argument("--kl-loss-coef", type=float, default=0.2, help="low_var_kl to the RL start checkpoint")
    g.add_argument(
        "--rl-batch", type=int, default=256, help="prompts per rollout (one step each); larger: quieter random control"
    )
    g.add_argument("--n-samples", type=int, default=8, help="--n-samples-per-prompt")
    g.add_argument("--rl-max-steps", type=int, default=150)
    g.add_argument("--rl-eval-interval", type=int, default=5)
    g.add_argument("--target", type=float, default=0.9)
    g.add_argument("--control-tolerance", type=float, default=0.05)
    g.add_argument("--skip-controls", action="store_true")
    g.add_argument(
        "--parallel-controls",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the two controls at once (each trainer on half the cores); their wall times then overlap",
    )
    g = p.add_argument_group("execution")
    g.add_argument(
        "--n-samples-per-eval-prompt", type=int, default=8, help="RL evals (SFT: see above); eval noise ~0.0045"
    )
    g.add_argument("--rollout-num-gpus", type=int, default=2, help="fake engines (each a process)")
    g.add_argument("--max-tokens-per-gpu", type=int, default=16384)
    g.add_argument("--max-running-requests", type=int, default=1024, help="--sglang-max-running-requests (per engine)")
    g.add_argument(
        "--reanalyse", action="store_true", help="rebuild JSON/PNG/table from --workdir and --out-json, run nothing"
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if a.reanalyse:
        return finish(a, json.loads((ROOT / a.out_json).read_text()))
    from bench.toy_reward_server import ToyRewardServer, write_remote_eval_file
    from examples.toy.prepare import prepare

    work = (ROOT / a.workdir).resolve()
    # The loop alternates rollout and training, so the CPU trainer may use every core (sim/fake_megatron/cpu_shim).
    os.environ.setdefault("SLIME_CPU_THREADS", str(os.cpu_count() or 1))
    t_all = time.perf_counter()
    model_kwargs = {k: getattr(a, k) for k in ("hidden_size", "num_layers", "num_heads", "num_kv_heads")}
    model_kwargs["intermediate_size"] = a.intermediate_size
    paths = prepare(work / "assets", a.num_train, a.num_eval, a.data_seed, model_kwargs=model_kwargs)
    eval_remote = write_remote_eval_file(paths["eval"], work / "assets" / "data" / "eval_remote_rm.jsonl", RM_KEY)
    res: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}",
        "argv": sys.argv[1:] if argv is None else argv,
        "model": model_kwargs,
        "band": list(a.band),
        "target": a.target,
        "control_tolerance": a.control_tolerance,
        "eval_samples": a.num_eval * a.n_samples_per_eval_prompt,
        "sft_eval_samples": a.num_eval * a.sft_eval_samples_per_prompt,
    }

    # ---- 1. SFT warm-up: stop at the first eval inside the band --------------------------------------------
    sft_dir = work / "sft"
    lo, hi = a.band
    in_band = lambda v: lo <= v <= hi  # noqa: E731
    sft_flags = [
        *common_flags(a, paths["model"], paths["train"]),
        "--rollout-function-path", "slime.rollout.sft_rollout.generate_rollout",
        "--eval-function-path", "slime.rollout.sglang_rollout.generate_rollout",
        "--eval-prompt-data", "toy", str(paths["eval"]), "--eval-interval", str(a.sft_eval_interval),
        "--n-samples-per-eval-prompt", str(a.sft_eval_samples_per_prompt),
        "--custom-rm-path", "examples.toy.reward.reverse_digits_rm", "--loss-type", "sft_loss",
        "--rollout-batch-size", str(a.sft_batch), "--global-batch-size", str(a.sft_batch),
        "--num-rollout", str(a.sft_max_steps), "--lr", str(a.sft_lr),
        "--save-hf", str(sft_dir / "hf_{rollout_id}"), "--save-interval", str(a.sft_eval_interval),
    ]  # fmt: skip
    logger.info("SFT warm-up (at most %d steps)", a.sft_max_steps)
    sft_run = run_slime(sft_flags, sft_dir, stop=lambda c: first_at_or_after(c, in_band) is not None)
    sft_curve = eval_curve(sft_dir)
    chosen = first_at_or_after(sft_curve, in_band)
    if chosen is None:
        raise SystemExit(f"SFT never evaluated inside {a.band}: {sft_curve}; lower --sft-lr or raise --sft-max-steps")
    ckpt = sft_dir / f"hf_{chosen - 1}"  # saved after rollout chosen-1, i.e. the weights eval step `chosen` saw
    res["sft"] = {**sft_run, "checkpoint": str(ckpt.relative_to(ROOT) if ckpt.is_relative_to(ROOT) else ckpt)}
    logger.info("RL starts from %s (SFT step %d, eval %.3f)", ckpt, chosen, dict(sft_curve)[chosen])

    # ---- 2. GRPO until the target ------------------------------------------------------------------------
    runs: dict[str, Any] = {}
    toy_rm = ["--custom-rm-path", "examples.toy.reward.reverse_digits_rm"]
    toy_eval = ["--eval-prompt-data", "toy", str(paths["eval"])]
    reached = lambda c: first_at_or_after(c, lambda v: v >= a.target) is not None  # noqa: E731
    base = [*rl_flags(a, ckpt, paths["train"], a.rl_max_steps), "--lr", str(a.rl_lr)]
    logger.info("GRPO (at most %d steps)", a.rl_max_steps)
    runs["grpo"] = run_slime([*base, *toy_rm, *toy_eval], work / "grpo", stop=reached)
    curve = eval_curve(work / "grpo")
    first = first_at_or_after(curve, lambda v: v >= a.target)
    steps = first if first is not None else max((s for s, _ in curve), default=a.rl_max_steps)

    # ---- 3. controls: same checkpoint, same number of steps ----------------------------------------------
    if not a.skip_controls:
        ctl = rl_flags(a, ckpt, paths["train"], steps)
        with ToyRewardServer() as srv:
            rnd = [*ctl, "--lr", str(a.rl_lr), "--rm-type", "random", "--rm-url", srv.url, "--metadata-key", RM_KEY]
            jobs = {
                "lr0": ([*ctl, "--lr", "0", *toy_rm, *toy_eval], work / "lr0", None),
                "random": ([*rnd, "--eval-prompt-data", "toy", str(eval_remote)], work / "random", None),
            }
            if a.parallel_controls:
                # independent runs: side by side they fill the cores each leaves idle between its phases
                logger.info("controls --lr 0 and --rm-type random side by side (%d steps each)", steps)
                threads = str(max(1, int(os.environ["SLIME_CPU_THREADS"]) // 2))
                runs.update(run_side_by_side(jobs, env={"SLIME_CPU_THREADS": threads}))
            else:
                for name, (flags, d, _) in jobs.items():
                    logger.info("control %s (%d steps)", name, steps)
                    runs[name] = run_slime(flags, d, stop=None)
    res["rl"] = runs
    res["total_wall_s"] = round(time.perf_counter() - t_all, 1)
    return finish(a, res)


def analyse(a: argparse.Namespace, res: dict[str, Any]) -> dict[str, Any]:
    """Curves, stop points and verdicts from the run directories (`res` holds the live wall times).

    A stopped run may log a few more evals while it shuts down: they go to `curve_after_stop` and count
    for nothing. Controls are judged against the RL runs' common step-0 eval (same checkpoint, same seeds).
    """
    work = (ROOT / a.workdir).resolve()
    lo, hi = a.band
    sft_all = eval_curve(work / "sft")
    chosen = first_at_or_after(sft_all, lambda v: lo <= v <= hi)
    res["sft"].update(curve=[c for c in sft_all if chosen is None or c[0] <= chosen], chosen_step=chosen)
    res["sft"]["curve_after_stop"] = [c for c in sft_all if chosen is not None and c[0] > chosen]
    if chosen is not None:
        res["sft"]["chosen_eval"] = dict(sft_all)[chosen]
        res["sft"].setdefault("wall_to_stop_s", _wall_to(work / "sft", chosen))
    rl = res["rl"]
    g_all = eval_curve(work / "grpo")
    first = first_at_or_after(g_all, lambda v: v >= a.target)
    rl["grpo"]["curve"] = [c for c in g_all if first is None or c[0] <= first]
    rl["grpo"]["curve_after_stop"] = [c for c in g_all if first is not None and c[0] > first]
    rl["grpo"]["first_step_at_target"] = first
    if first is not None:
        rl["grpo"].setdefault("wall_to_stop_s", _wall_to(work / "grpo", first))
    rl["steps"] = rl["grpo"]["curve"][-1][0]
    rl["start_eval"] = rl["grpo"]["curve"][0][1]
    rl["grpo"]["gain"] = round(rl["grpo"]["curve"][-1][1] - rl["start_eval"], 4)
    rl["grpo"]["truncated_ratio"] = _eval_series(work / "grpo", "eval/toy/truncated_ratio", upto=first)
    for key in ("lr0", "random"):
        if key in rl:
            rl[key]["curve"] = eval_curve(work / key)
            dev = [v - rl["start_eval"] for _, v in rl[key]["curve"]]
            rl[key]["max_abs_deviation"] = round(max(abs(d) for d in dev), 4)
            rl[key]["max_gain"] = round(max(dev), 4)
            rl[key]["within_tolerance"] = max(abs(d) for d in dev) <= a.control_tolerance
            rl[key]["final_change_over_grpo_gain"] = (
                round(dev[-1] / rl["grpo"]["gain"], 3) if rl["grpo"]["gain"] else None
            )
            rl[key]["truncated_ratio"] = _eval_series(work / key, "eval/toy/truncated_ratio")
    res["verdict"] = {
        "sft_checkpoint_in_band": chosen is not None,
        "grpo_reaches_target": first is not None,
        "lr0_within_tolerance": rl.get("lr0", {}).get("within_tolerance"),
        "random_within_tolerance": rl.get("random", {}).get("within_tolerance"),
    }
    return res


def _wall_to(run_dir: Path, step: int) -> float | None:
    """Seconds from the run's start (command.txt written) to its eval record at `step`."""
    rec = next((r for r in read_metrics(run_dir / "metrics.jsonl", "eval") if r["step"] == step), None)
    start = run_dir / "command.txt"
    return round(rec["wall_time"] - start.stat().st_mtime, 1) if rec and start.is_file() else None


def _eval_series(run_dir: Path, key: str, upto: int | None = None) -> list[tuple[int, float]]:
    recs = read_metrics(run_dir / "metrics.jsonl", "eval")
    return [
        (r["step"], r["metrics"][key]) for r in recs if key in r["metrics"] and (upto is None or r["step"] <= upto)
    ]


def finish(a: argparse.Namespace, res: dict[str, Any]) -> dict[str, Any]:
    res = analyse(a, res)
    out = ROOT / a.out_json
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n")
    print_table(res)  # the table first: a plotting failure must not hide the result
    plot(ROOT / a.png, res)
    return res


def print_table(res: dict[str, Any]) -> None:
    rl, sft = res["rl"], res["sft"]
    print(
        f"\nSFT: chosen step {sft['chosen_step']} (eval {sft['chosen_eval']:.3f}), {sft.get('wall_to_stop_s')} s to it"
    )
    print(f"{'run':<8} {'steps':>5} {'start':>6} {'final':>6} {'min':>6} {'max':>6} {'trunc':>6} {'to stop s':>9}")
    for key in ("grpo", "lr0", "random"):
        if key in rl:
            vals = [v for _, v in rl[key]["curve"]]
            trunc = rl[key]["truncated_ratio"][-1][1] if rl[key].get("truncated_ratio") else float("nan")
            secs = rl[key].get("wall_to_stop_s") or rl[key]["wall_s"]
            print(f"{key:<8} {rl[key]['curve'][-1][0]:>5} {vals[0]:>6.3f} {vals[-1]:>6.3f} {min(vals):>6.3f} "
                  f"{max(vals):>6.3f} {trunc:>6.3f} {secs:>9.0f}")  # fmt: skip
    g = rl["grpo"]
    print(f"GRPO: first eval >= {res['target']} at RL step {g['first_step_at_target']}; gain {g['gain']:+.3f}")
    for key in ("lr0", "random"):
        if key in rl:
            c = rl[key]
            print(
                f"{key}: max |eval - start| = {c['max_abs_deviation']:.3f} (tolerance {res['control_tolerance']}), "
                f"max gain {c['max_gain']:+.3f}, final change / GRPO gain = {c['final_change_over_grpo_gain']:+.2f}"
            )
    print(f"total wall time {res['total_wall_s']:.0f} s; verdict {res['verdict']}")


if __name__ == "__main__":
    main()
