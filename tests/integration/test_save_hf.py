"""`--save-hf` (issue 5): the exported directory loads with `AutoModelForCausalLM.from_pretrained` and gives the
trainer's logits (atol 1e-4).

Two real trainer ranks with TP=2 (CPU, gloo; spawned) take one optimizer step, so the weights are no longer
the checkpoint's, compute logits of a few sequences (vocab-parallel shards gathered over TP), and write the HF
export collectively. transformers then loads it; its logits must match the trainer's, and (negative control)
the original checkpoint's must not.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from sim.rank_spawn import spawn_ranks
from slime.utils.http_utils import find_free_port

pytestmark = [pytest.mark.cpu, pytest.mark.slow]

SHIM = "sim.fake_megatron.cpu_shim.apply"
SEQS = [[5, 9, 33, 100, 7, 8, 200, 3], [11, 12, 13], [300, 2, 2, 2, 41, 17]]


def _worker(rank: int, ckpt: str, out: str, port: int) -> None:
    from slime.arguments import parse_args
    from slime.ray.train_actor import TrainRayActor
    from slime.ray.train_data import build_rank_data
    from slime.scheduling.carry import CarryBuffer
    from slime.utils.types import Sample, Status

    torch.set_num_threads(1)
    args = parse_args([
        "--hf-checkpoint", ckpt, "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--num-rollout", "1",
        "--rollout-num-gpus", "1", "--actor-num-gpus-per-node", "2", "--tensor-model-parallel-size", "2",
        "--lr", "1e-2", "--entropy-coef", "0.01", "--custom-megatron-init-path", SHIM,
    ])  # fmt: skip
    actor = TrainRayActor(args, rank, 2)
    actor.init("127.0.0.1", port)
    trainer = actor.backend.trainer
    rng = random.Random(0)
    samples = [
        Sample(index=i, group_index=i // 2, group_id=i, tokens=[rng.randrange(3, 400) for _ in range(9)],
               response_length=4, reward=float(i % 2), status=Status.COMPLETED)
        for i in range(4)
    ]  # fmt: skip
    data, _ = build_rank_data(args, 0, samples, CarryBuffer(), {"dp_size": 1, "cp_size": 1})
    assert trainer.train(0, data[0])["train/update_successful"] == 1.0
    with torch.no_grad():
        logits, _ = trainer._forward_logits({"tokens": SEQS})
        full = torch.cat(trainer.ps.all_gather(logits.contiguous(), "tp"), dim=-1)[:, : trainer.spec.vocab_size]
    actor.call("save_hf", str(Path(out) / "hf_0"))
    if rank == 0:
        torch.save(full, Path(out) / "trainer_logits.pt")


def test_save_hf_loads_in_transformers_with_trainer_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    from sim.tiny_checkpoint import build_tiny_checkpoint

    ckpt = str(build_tiny_checkpoint(tmp_path / "model"))
    spawn_ranks(_worker, args=(ckpt, str(tmp_path), find_free_port()), nprocs=2)
    out = tmp_path / "hf_0"
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert "model.embed_tokens.weight" in index["weight_map"]
    trainer_logits = torch.load(tmp_path / "trainer_logits.pt")
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    original = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    start = 0
    with torch.no_grad():
        for seq in SEQS:
            mine = trainer_logits[start : start + len(seq)]
            start += len(seq)
            got = exported(torch.tensor([seq])).logits[0]
            torch.testing.assert_close(got, mine, atol=1e-4, rtol=0)
            assert (original(torch.tensor([seq])).logits[0] - mine).abs().max() > 1e-3  # the step changed them
