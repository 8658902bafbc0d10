"""Every hook flag of `slime train` runs with slime v0.3.0's signature, through the real CLI, Ray, router and fake
engines: a hook that is parsed and silently dropped would fail here. The hooks live in slime_hooks.py and write
one JSON line per call.

Also covered by the same runs: --train-env-vars reaches the train actors (and only them), a data source written
against slime v0.3.0's `DataSource` saves and resumes unchanged, and --disable-compute-advantages-and-returns
leaves the advantages to --rollout-data-postprocess-path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from examples.toy.prepare import prepare

pytestmark = [pytest.mark.cpu, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("toy")
    prepare(out, num_train=32, num_eval=4)  # in-process: ~0.02 s, not a ~6 CPU-s interpreter
    return out


def run(argv: list[str], log: Path, hook_log: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{HERE}", "SLIME_HOOK_LOG": str(hook_log)}
    env.pop("SLIME_HOOK_TRAIN_MARK", None)
    out = subprocess.run(
        [sys.executable, "-m", "slime.cli", "train", *argv], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=900,
    )  # fmt: skip
    log.write_text(out.stdout + out.stderr)
    assert out.returncode == 0, (out.stdout + out.stderr)[-6000:]
    return out


def calls(hook_log: Path, hook: str) -> list[dict]:
    return [r for r in map(json.loads, hook_log.read_text().splitlines()) if r["hook"] == hook]


def test_every_hook_runs_with_slimes_signature(assets: Path, tmp_path: Path) -> None:
    hook_log, save = tmp_path / "hooks.jsonl", tmp_path / "ckpt"
    base = [
        "--hf-checkpoint", str(assets / "model"), "--prompt-data", str(assets / "data" / "train.jsonl"),
        "--input-key", "input", "--label-key", "label", "--apply-chat-template",
        "--custom-rm-path", "examples.toy.reward.reverse_digits_rm",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "4",
        "--rollout-max-response-len", "6", "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1",
        "--rollout-num-gpus", "1", "--rollout-engine", "sim", "--sim-engine", "hf", "--lr", "1e-3",
        "--custom-megatron-init-path", "sim.fake_megatron.cpu_shim.apply",
        "--eval-prompt-data", "toy", str(assets / "data" / "eval.jsonl"), "--eval-interval", "1",
        "--data-source-path", "slime_hooks.SlimeStyleDataSource",
        "--custom-convert-samples-to-train-data-path", "slime_hooks.convert",
        "--custom-rollout-log-function-path", "slime_hooks.rollout_log",
        "--custom-eval-rollout-log-function-path", "slime_hooks.eval_log",
        "--custom-megatron-before-log-prob-hook-path", "slime_hooks.before_log_prob",
        "--custom-megatron-before-train-step-hook-path", "slime_hooks.before_train_step",
        "--rollout-data-postprocess-path", "slime_hooks.postprocess", "--disable-compute-advantages-and-returns",
        "--loss-type", "custom_loss", "--custom-loss-function-path", "slime_hooks.custom_loss",
        "--use-kl-loss", "--kl-loss-coef", "0.0", "--ref-update-interval", "1",
        "--train-env-vars", json.dumps({"SLIME_HOOK_TRAIN_MARK": "train-only"}),
        "--save", str(save), "--save-interval", "1",
    ]  # fmt: skip
    metrics = tmp_path / "run"
    run([*base, "--num-rollout", "2", "--metrics-dir", str(metrics)], tmp_path / "run.log", hook_log)
    summary = json.loads((metrics / "summary.json").read_text())

    # rollout side: conversion once per rollout, logging hooks with slime's arguments; True skips our logging
    assert [c["n"] for c in calls(hook_log, "convert")] == [4, 4]
    assert [c["rollout_id"] for c in calls(hook_log, "rollout_log")] == [0, 1]
    logged = [json.loads(x) for x in (metrics / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged if r["kind"] == "rollout"] == [1]
    assert [c["rollout_id"] for c in calls(hook_log, "eval_log")] == [0, 1, 2]
    assert all(c["datasets"] == ["toy"] for c in calls(hook_log, "eval_log"))

    # train side: log-prob hook before the π_old and π_ref passes, train-step hook before each optimizer step
    assert [c["store_prefix"] for c in calls(hook_log, "before_log_prob")] == ["", "ref_", "", "ref_"]
    assert all(c["model_is_list"] for c in calls(hook_log, "before_log_prob"))
    steps = calls(hook_log, "before_train_step")
    assert [(c["rollout_id"], c["step_id"]) for c in steps] == [(0, 0), (1, 0)]
    assert all(c["has_scheduler"] and c["lr"] > 0 for c in steps)

    # --train-env-vars: the train actors see it; the rollout side (same Ray cluster) does not
    assert all(c["env_mark"] == "train-only" for c in steps)
    assert summary["train_status"][0]["env"] == {"SLIME_HOOK_TRAIN_MARK": "train-only"}

    # --disable-compute-advantages-and-returns: none computed; the postprocess hook's reach the custom loss
    post = calls(hook_log, "postprocess")
    assert [c["rollout_id"] for c in post] == [0, 1]
    assert not any(c["had_advantages"] for c in post)
    assert all(c["hook_mark"] == [7] for c in post)  # the custom conversion's per-sample key reached the trainer
    losses = calls(hook_log, "custom_loss")
    assert losses and all(c["requires_grad"] and c["advantages_ok"] for c in losses)
    assert all(len(c["logits_shape"]) == 2 and c["logits_shape"][1] >= 512 for c in losses)
    assert all(summary["metrics"][str(r)]["train/grad_norm"] > 0 for r in (0, 1))

    # a slime-style data source saves under args.save/rollout/ itself
    assert [c["rollout_id"] for c in calls(hook_log, "data_source_save")] == [0, 1]
    assert (save / "rollout" / "global_dataset_state_dict_1.pt").is_file()

    # ... and resumes unchanged: load(rollout_id) from args.load, one more rollout
    resumed = tmp_path / "resumed"
    run(
        [*base, "--num-rollout", "3", "--load", str(save), "--metrics-dir", str(resumed), "--skip-eval-before-train"],
        tmp_path / "resume.log",
        hook_log,
    )
    loads = calls(hook_log, "data_source_load")
    assert [c["rollout_id"] for c in loads] == [1]
    assert loads[0]["offset"] == calls(hook_log, "data_source_save")[1]["offset"]
    assert sorted(json.loads((resumed / "summary.json").read_text())["hashes"]) == ["2"]
