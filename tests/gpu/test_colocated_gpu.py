"""One GPU, colocated: `slime train --colocate --bf16` with the fake `hf` engine on CUDA, through the same CLI as a
user's job. Every weight sync is checked tensor by tensor against the trainer (`--check-weight-update-equal`),
the engine samples with the synced weights (the trainer's log-probs of the sampled tokens agree within bf16
noise), and every step reports its phases and the sync's parts.

Tolerance: engine (HF eager attention, bf16) and trainer (megatron, bf16) compute the same log-probs with different
kernels and summation orders; per token the difference is a few bf16 ulps of the logits (~1e-2 nats), the mean
over tokens ~1e-2 (0.014–0.016 measured on the ~1.2B shape on the H200). Equality of the weights themselves is
what the checksums check.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

MEAN_TOL = 0.05


def test_colocated_bf16_syncs_exact_weights_every_rollout(toy: Path, tmp_path: Path) -> None:
    from sim.slime_run import run_slime_train

    out = tmp_path / "run"
    argv = [
        "--hf-checkpoint", str(toy / "model"), "--prompt-data", str(toy / "data" / "train.jsonl"),
        "--input-key", "input", "--label-key", "label", "--apply-chat-template",
        "--custom-rm-path", "examples.toy.reward.reverse_digits_rm", "--rollout-engine", "sim", "--sim-engine", "hf",
        "--colocate", "--bf16", "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1",
        "--rollout-batch-size", "8", "--n-samples-per-prompt", "4", "--global-batch-size", "32", "--num-rollout", "3",
        "--rollout-max-response-len", "16", "--lr", "1e-4", "--seed", "1234", "--check-weight-update-equal",
        "--metrics-dir", str(out), "--no-use-tensorboard",
    ]  # fmt: skip
    log = tmp_path / "run.log"
    assert run_slime_train(argv, log, timeout=480) == 0, log.read_text()[-6000:]
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    train = [r["metrics"] for r in records if r["kind"] == "train"]
    assert len(train) == 3
    for m in train:
        assert m["weight_sync/checked_engines"] == 1 and m["weight_sync/checked_tensors"] > 0, m
        assert m["weight_sync/bytes"] > 0
        assert {"weight_sync/export_s", "weight_sync/pack_s", "weight_sync/post_s"} <= set(m)
        assert m["train/train_rollout_logprob_abs_diff"] < MEAN_TOL, m
    print(json.dumps([{k: v for k, v in m.items() if k.startswith(("time/", "weight_sync/", "train/train_rollout"))}
                      for m in train], indent=1))  # fmt: skip
