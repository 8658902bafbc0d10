"""The quick start: a random-init model learns the toy task through `slime train`, in two runs.

1. **SFT warm-up** (`--loss-type sft_loss`, labels as responses): `slime train --debug-train-only` with the SFT
   rollout function. It needs no inference server at all, so it starts fast; it ends with an HF checkpoint.
2. **GRPO** from that checkpoint: the real loop (Ray, the real sglang-router, fake `hf` engines, weight sync
   after every step), evaluated on held-out prompts every few steps, stopped once the eval reward reaches the
   target.

Then it prints the eval curve as a table and draws `OUT/learning.png`. `--smoke` runs 3 GRPO rollouts of the
tiny default model instead (the fast check that everything is wired). The recipe (model size, batch, learning
rate) is chosen for wall time on a 2-core laptop; `docs/performance.md#quick-start` records what it takes.

    python -m examples.toy.quickstart [--out runs/toy] [--smoke] [-- extra slime train flags]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
logger = logging.getLogger("quickstart")

STOP_GRACE_S = 90.0  # a clean shutdown (engines, router, Ray) takes seconds; past this, something hangs
MODEL = {"hidden_size": 128, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 256}


def slime_cmd() -> list[str]:
    exe = ROOT / ".venv" / "bin" / "slime"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "slime.cli"]


def common(paths: dict[str, Path], checkpoint: Path) -> list[str]:
    return [
        "--hf-checkpoint", str(checkpoint), "--prompt-data", str(paths["train"]),
        "--input-key", "input", "--label-key", "label", "--apply-chat-template", "--rollout-shuffle",
        "--custom-rm-path", "examples.toy.reward.reverse_digits_rm",
        "--rollout-max-response-len", "12", "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1",
        "--custom-megatron-init-path", "sim.fake_megatron.cpu_shim.apply", "--data-pad-size-multiplier", "1",
        "--use-dynamic-batch-size", "--max-tokens-per-gpu", "16384",
    ]  # fmt: skip


def sft_flags(a: argparse.Namespace, paths: dict[str, Path], save_hf: Path) -> list[str]:
    """The SFT warm-up's job: the labels as responses, no inference server; ends with an HF checkpoint."""
    return [
        *common(paths, paths["model"]), "--debug-train-only",
        "--rollout-function-path", "slime.rollout.sft_rollout.generate_rollout", "--loss-type", "sft_loss",
        "--rollout-batch-size", "64", "--global-batch-size", "64", "--num-rollout", str(a.sft_steps),
        "--lr", str(a.sft_lr), "--seed", str(a.seed), "--save-hf", str(save_hf), "--no-use-tensorboard",
    ]  # fmt: skip


def grpo_flags(a: argparse.Namespace, paths: dict[str, Path], checkpoint: Path) -> list[str]:
    """The GRPO phase's job (also `bench/toy_async.py`'s, which runs it synchronously and fully async)."""
    return [
        *common(paths, checkpoint), "--rollout-engine", "sim", "--sim-engine", "hf",
        "--rollout-num-gpus", "2", "--rollout-batch-size", str(a.prompts), "--n-samples-per-prompt", str(a.samples),
        "--global-batch-size", str(a.prompts * a.samples), "--num-rollout", str(a.rl_max_steps),
        "--advantage-estimator", "grpo", "--lr", str(a.rl_lr), "--lr-warmup-iters", "5", "--adam-eps", "1e-3",
        "--clip-grad", "0.2", "--calculate-per-token-loss", "--use-rollout-logprobs", "--seed", str(a.seed),
        "--rollout-temperature", "1.0", "--sglang-max-running-requests", "1024",
        "--eval-prompt-data", "toy", str(paths["eval"]), "--eval-interval", str(a.eval_interval),
        "--n-samples-per-eval-prompt", "4", "--eval-temperature", "1.0", "--eval-fixed-sampling-seed",
        "--sglang-enable-deterministic-inference",  # SGLang honours the fixed eval seeds only under it
    ]  # fmt: skip


def eval_curve(metrics_dir: Path, name: str = "toy") -> list[tuple[int, float]]:
    """(step, held-out reward) of every eval logged so far (the file may be mid-write: a torn line is skipped)."""
    out = []
    path = metrics_dir / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if rec.get("kind") == "eval" and f"eval/{name}" in rec["metrics"]:
            out.append((rec["step"], float(rec["metrics"][f"eval/{name}"])))
    return out


def run(flags: list[str], metrics_dir: Path, stop_at: float | None = None) -> float:
    """`slime train FLAGS` with its console passed through; interrupted (SIGINT: it shuts down cleanly) once an
    eval reaches `stop_at`. Returns the wall time in seconds."""
    metrics_dir.mkdir(parents=True, exist_ok=True)
    (metrics_dir / "metrics.jsonl").unlink(missing_ok=True)
    cmd = [*slime_cmd(), "train", *flags, "--metrics-dir", str(metrics_dir)]
    t0 = time.perf_counter()
    # Its own session: SIGINT goes to the driver alone. SIGINT restored to default: a shell starts background
    # jobs with it ignored, which the child would inherit and then never stop.
    proc = subprocess.Popen(
        cmd, cwd=ROOT, start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)
    )
    stopped = None
    try:
        while proc.poll() is None:
            time.sleep(1.0)
            if stop_at is not None and stopped is None and any(v >= stop_at for _, v in eval_curve(metrics_dir)):
                logger.info("held-out reward reached %.2f: stopping the run", stop_at)
                proc.send_signal(signal.SIGINT)
                stopped = time.monotonic()
            elif stopped is not None and time.monotonic() - stopped > STOP_GRACE_S:
                logger.warning(
                    "slime train still running %.0f s after SIGINT: killing its process group", STOP_GRACE_S
                )
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if proc.returncode != 0 and stopped is None:
            raise SystemExit(f"slime train failed (exit {proc.returncode}); logs in {metrics_dir}/logs")
    except BaseException:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        raise
    return time.perf_counter() - t0


def table(curve: list[tuple[int, float]], sft_steps: int) -> str:
    rows = [f"{'phase':<6} {'step':>5}  held-out reward", f"{'-' * 6} {'-' * 5}  {'-' * 15}"]
    for step, value in curve:
        bar = "#" * round(value * 40)
        rows.append(f"{'GRPO':<6} {step:>5}  {value:.3f} {bar}")
    rows.insert(2, f"{'SFT':<6} {sft_steps:>5}  (warm-up; GRPO step 0 is its eval)")
    return "\n".join(rows)


def plot(path: Path, curve: list[tuple[int, float]], target: float, walls: dict[str, float]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([s for s, _ in curve], [v for _, v in curve], "o-", color="tab:blue", label="GRPO, held-out eval")
    ax.axhline(target, color="tab:green", ls=":", label=f"target {target}")
    ax.set_xlabel("GRPO step (step 0: the SFT warm-up checkpoint)")
    ax.set_ylabel("reward on held-out prompts (T = 1)")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"toy task: SFT {walls['sft']:.0f} s, then GRPO {walls['grpo']:.0f} s")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/toy")
    p.add_argument("--smoke", action="store_true", help="3 GRPO rollouts of the tiny model (wiring check)")
    p.add_argument("--target", type=float, default=0.9, help="stop GRPO once the held-out reward reaches this")
    p.add_argument("--sft-steps", type=int, default=100)
    p.add_argument("--sft-lr", type=float, default=1e-3)
    p.add_argument("--rl-max-steps", type=int, default=150)
    p.add_argument("--rl-lr", type=float, default=2e-3)
    p.add_argument("--prompts", type=int, default=128, help="prompts per GRPO step")
    p.add_argument("--samples", type=int, default=8, help="samples per prompt")
    p.add_argument("--eval-interval", type=int, default=5)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--num-train", type=int, default=4096, help="training prompts (GRPO sees each once per epoch)")
    a, extra = p.parse_known_args(argv)
    return a, [x for x in extra if x != "--"]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a, extra = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    from examples.toy.prepare import prepare

    out = (ROOT / a.out).resolve() if not os.path.isabs(a.out) else Path(a.out)
    os.environ.setdefault("SLIME_CPU_THREADS", str(os.cpu_count() or 1))  # the loop alternates: trainer may use all
    t_all = time.perf_counter()
    if a.smoke:
        paths = prepare(out / "assets")
        flags = [
            *common(paths, paths["model"]), "--rollout-batch-size", "8", "--n-samples-per-prompt", "4",
            "--global-batch-size", "32", "--num-rollout", "3", "--rollout-num-gpus", "2",
            "--rollout-engine", "sim", "--sim-engine", "hf", "--save-debug-rollout-data",
            str(out / "dump" / "rollout_{rollout_id}.pt"), *extra,
        ]  # fmt: skip
        wall = run(flags, out)
        logger.info("smoke run done in %.0f s; metrics in %s, rollouts in %s/dump", wall, out, out)
        return {"smoke_wall_s": wall}

    paths = prepare(out / "assets", num_train=a.num_train, num_eval=128, model_kwargs=MODEL)
    walls: dict[str, float] = {}
    logger.info("1/2 SFT warm-up: %d steps of the labels, no inference server", a.sft_steps)
    walls["sft"] = run(sft_flags(a, paths, out / "sft_hf"), out / "sft")

    logger.info("2/2 GRPO from the SFT checkpoint until the held-out reward reaches %.2f", a.target)
    rl_flags = [*grpo_flags(a, paths, out / "sft_hf"), "--save-debug-rollout-data",
                str(out / "dump" / "rollout_{rollout_id}.pt"), *extra]  # fmt: skip
    walls["grpo"] = run(rl_flags, out / "grpo", stop_at=a.target)
    curve = eval_curve(out / "grpo")
    total = time.perf_counter() - t_all
    print(table(curve, a.sft_steps))
    reached = next((s for s, v in curve if v >= a.target), None)
    result = {
        "target": a.target, "reached_at_step": reached, "final_eval": curve[-1][1] if curve else None,
        "curve": curve, "wall_s": {**{k: round(v, 1) for k, v in walls.items()}, "total": round(total, 1)},
    }  # fmt: skip
    (out / "learning.json").write_text(json.dumps(result, indent=1))
    try:
        plot(out / "learning.png", curve, a.target, walls)
    except ImportError as e:  # the table and JSON above are the result; the picture is a view of it
        logger.warning("learning.png not drawn (%s)", e)
    verdict = f"reached {a.target} at GRPO step {reached}" if reached is not None else f"did not reach {a.target}"
    print(f"{verdict}; total {total:.0f} s (SFT {walls['sft']:.0f} s, GRPO {walls['grpo']:.0f} s)")
    print(f"curve: {out / 'learning.png'}  metrics: {out / 'grpo' / 'metrics.jsonl'}  rollouts: slime inspect "
          f"{out / 'dump' / 'rollout_0.pt'}")  # fmt: skip
    return result


if __name__ == "__main__":
    main()
