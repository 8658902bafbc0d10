"""`--loss-type sft_loss` skips the old-policy log-prob pass (it reads only the live forward), policy_loss keeps it.

One spawned CPU/gloo rank trains one step of each loss type on the same samples; the trainer's
`_compute_logprobs` is wrapped to record which keys it fills. The SFT loss must equal the negative group token
mean of the pre-step log-probs, computed here from a separate no-grad pass.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from sim.rank_spawn import spawn_ranks
from slime.utils.http_utils import find_free_port

pytestmark = pytest.mark.cpu

SHIM = "sim.fake_megatron.cpu_shim.apply"


def _worker(rank: int, port: int, ckpt: str, out: str) -> None:
    import torch

    from slime.arguments import parse_args
    from slime.backends.megatron.initialize import destroy_megatron
    from slime.backends.megatron.microbatch import microbatches
    from slime.backends.megatron.trainer import MegatronTrainer
    from slime.ray.train_data import build_rank_data
    from slime.scheduling.carry import CarryBuffer
    from slime.utils.types import Sample, Status

    torch.set_num_threads(1)
    result = {}
    for loss_type in ("sft_loss", "policy_loss"):
        args = parse_args([
            "--hf-checkpoint", ckpt, "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
            "--global-batch-size", "8", "--num-rollout", "1", "--rollout-num-gpus", "1",
            "--actor-num-gpus-per-node", "1", "--lr", "1e-3", "--loss-type", loss_type,
            "--custom-megatron-init-path", SHIM,
        ])  # fmt: skip
        trainer = MegatronTrainer(args, rank, 1, "127.0.0.1", port)
        rng = random.Random(0)
        vocab = trainer.spec.vocab_size
        samples = []
        for i in range(8):
            r = rng.randint(2, 6)
            tokens = [rng.randrange(3, vocab) for _ in range(rng.randint(4, 8) + r)]
            samples.append(Sample(group_index=i // 2, index=i, group_id=i, tokens=tokens, response_length=r,
                                  reward=rng.random(), status=Status.COMPLETED,
                                  rollout_log_probs=[-1.0] * r))  # fmt: skip
        data, _ = build_rank_data(args, 0, samples, CarryBuffer(), {"dp_size": 1, "cp_size": 1})
        ref_mbs = microbatches(data[0])
        trainer._compute_logprobs(ref_mbs, "log_probs")
        sums = [float(lp.sum()) for mb in ref_mbs for lp in mb.log_probs]
        counts = [len(lp) for mb in ref_mbs for lp in mb.log_probs]
        filled: list[str] = []
        original = trainer._compute_logprobs

        def spy(mbs, key, original=original, filled=filled):
            filled.append(key)
            return original(mbs, key)

        trainer._compute_logprobs = spy
        metrics = trainer.train(0, data[0])
        # one sample per trajectory here, so each group's token mean is the sample's mean; groups weigh 1/b
        expected = -sum(s / c for s, c in zip(sums, counts, strict=True)) / len(sums)
        result[loss_type] = {"filled": filled, "loss": metrics["train/loss"], "expected_sft": expected,
                             "grad_norm": metrics["train/grad_norm"]}  # fmt: skip
        destroy_megatron()
        port = find_free_port()
    Path(out).write_text(json.dumps(result))


def test_sft_skips_old_logprob_pass(tmp_path):
    from sim.tiny_checkpoint import build_tiny_checkpoint

    ckpt = str(build_tiny_checkpoint(tmp_path / "model"))
    out = tmp_path / "result.json"
    spawn_ranks(_worker, args=(find_free_port(), ckpt, str(out)), nprocs=1)
    r = json.loads(out.read_text())
    assert r["sft_loss"]["filled"] == [], r["sft_loss"]
    assert r["policy_loss"]["filled"] == ["log_probs"], r["policy_loss"]
    assert abs(r["sft_loss"]["loss"] - r["sft_loss"]["expected_sft"]) < 1e-5, r["sft_loss"]
    assert r["sft_loss"]["grad_norm"] > 0
