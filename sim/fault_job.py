"""The toy job that faults are injected into (tests/integration/test_trainer_faults.py, bench/faults.py), and how
its trained prompts are counted across restarts.

One colocated trainer rank on the fake Megatron, one fake `hf` engine; 4 rollouts of 10 prompts × 1 sample, steps
of 4 groups, so 2 groups are carried over after rollouts 0 and 2 and the 40 prompts all train by the end; a
checkpoint after every rollout. Counting (as the resume tests do): every rollout's train data is dumped
(`--save-debug-rollout-data`) when it is made; an attempt that restarts from checkpoint k rewrites the dumps of
rollouts k+1.. and leaves those up to k, so the dumps left at the end are the lineage of the final weights.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from pathlib import Path
from typing import Any

TRAINED = re.compile(r"actor rank 0 rollout (?P<rollout>\d+): (?P<samples>\d+) samples")  # slime/ray/train_actor.py

NUM_ROLLOUT = 4
BATCH = 10  # prompts per rollout, one sample each
STEP = 4  # groups per train step
TRAIN_HANG_TIMEOUT = 10.0  # a toy step takes ~0.1 s, a save ~0.1 s
ROLLOUT_HANG_TIMEOUT = 15.0


def prepare_assets(out: Path) -> Path:
    from examples.toy.prepare import prepare

    prepare(out, num_train=64, num_eval=4)
    return out


def job_flags(
    assets: Path, run: Path, *, max_restarts: int = 0, hang_timeouts: bool = True, ppo: bool = False
) -> list[str]:
    """`ppo`: PPO instead of REINFORCE++, so a critic trains (and checkpoints) beside the actor."""
    flags = [
        "--hf-checkpoint", str(assets / "model"), "--prompt-data", str(assets / "data" / "train.jsonl"),
        "--input-key", "input", "--label-key", "label", "--apply-chat-template",
        "--custom-rm-path", "examples.toy.reward.reverse_digits_rm", "--rollout-engine", "sim", "--sim-engine", "hf",
        "--rollout-batch-size", str(BATCH), "--n-samples-per-prompt", "1", "--global-batch-size", str(STEP),
        "--num-rollout", str(NUM_ROLLOUT), "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1", "--colocate",
        "--rollout-max-response-len", "8", "--rollout-shuffle", "--advantage-estimator", "reinforce_plus_plus",
        "--custom-megatron-init-path", "sim.fake_megatron.cpu_shim.apply", "--lr", "1e-3",
        "--save", str(run / "ckpt"), "--save-interval", "1",
        "--save-debug-rollout-data", str(run / "dump" / "{rollout_id}.pt"), "--metrics-dir", str(run / "metrics"),
        "--max-restarts", str(max_restarts),
    ]  # fmt: skip
    if ppo:
        flags[flags.index("reinforce_plus_plus")] = "ppo"
    if hang_timeouts:
        flags += ["--train-hang-timeout", str(TRAIN_HANG_TIMEOUT), "--rollout-hang-timeout", str(ROLLOUT_HANG_TIMEOUT)]
    return flags


def fault_env(spec: str, marker: Path) -> dict[str, str]:
    """The environment of a run with fault `spec`, fired once per job (`slime/utils/faults.py`)."""
    root = str(Path(__file__).resolve().parents[1])
    return {**os.environ, "PYTHONPATH": root, "SLIME_FAULT": spec, "SLIME_FAULT_MARKER": str(marker)}


def lineage(run: Path) -> dict[str, Any]:
    """What the final weights were trained on: prompts (group indices) per rollout from the dumps left, and the
    samples train rank 0 received per rollout, from its own log (appended by every attempt; the last line of a
    rollout is the lineage's: an attempt that restarts from checkpoint k trains k+1.. again)."""
    import torch

    prompts: list[int] = []
    for rid in range(NUM_ROLLOUT):
        path = run / "dump" / f"{rid}.pt"
        if path.exists():
            samples = torch.load(path, weights_only=False)["samples"]
            prompts += [s["group_index"] for s in samples]
    trained: dict[int, int] = {}
    log = run / "metrics" / "logs" / "train_rank0.log"
    for line in log.read_text(errors="replace").splitlines() if log.exists() else []:
        if found := TRAINED.search(line):
            trained[int(found["rollout"])] = int(found["samples"])
    counts = Counter(prompts)
    expected = set(range(NUM_ROLLOUT * BATCH))
    return {
        "lost": len(expected - counts.keys()),
        "repeated": sum(n - 1 for n in counts.values() if n > 1),
        "unexpected": len(counts.keys() - expected),
        "rollouts_trained": sorted(trained),
        "samples_trained": sum(trained.values()),
    }


def restarts(run: Path) -> dict[str, Any] | None:
    path = run / "metrics" / "restarts.json"
    return json.loads(path.read_text()) if path.exists() else None
