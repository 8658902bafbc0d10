"""Checkpoint round trip on the CUDA defaults (issue 5): bf16 parameters, fp32 main parameters, megatron's
distributed optimizer with torch's Adam (no TransformerEngine), NCCL.

One spawned rank trains a rollout, saves, records the full optimizer state and the next rollout's loss; a
second spawned rank builds a fresh trainer, loads, and must hold the same bf16 parameters, fp32 main
parameters and Adam moments bit for bit, the same Adam step, and give the same next loss.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from slime.utils.http_utils import find_free_port

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _samples(vocab: int, rollout_id: int) -> list:
    from slime.utils.types import Sample, Status

    rng = random.Random(rollout_id)
    return [
        Sample(group_index=i // 2, index=i, group_id=i, tokens=[rng.randrange(3, vocab) for _ in range(12)],
               response_length=5, reward=rng.random(), status=Status.COMPLETED)
        for i in range(8)
    ]  # fmt: skip


def _state(trainer) -> dict[str, dict[str, torch.Tensor]]:
    """Per model parameter: bf16 param, fp32 main param and Adam moments, whole (DP=1: one shard is all)."""
    from slime.backends.megatron.hf_weights import unwrap_model

    subs = getattr(trainer.optimizer, "chained_optimizers", None) or [trainer.optimizer]
    out = {}
    for name, p in unwrap_model(trainer.model).named_parameters():
        entry = {"model": p.detach().float().cpu().clone()}
        for o in subs:
            for maps in o.gbuf_ranges:
                for buckets in maps.values():
                    for m in buckets:
                        if p in m["param_map"]:
                            local = o._get_main_param_and_optimizer_states(p)
                            entry.update({k: local[k].detach().float().cpu().clone() for k in ("param", "exp_avg", "exp_avg_sq")})  # fmt: skip
        out[name] = entry
    return out


def _worker(rank: int, phase: str, ckpt: str, out_dir: str, port: int) -> None:
    from slime.arguments import parse_args
    from slime.backends.megatron import checkpoint
    from slime.backends.megatron.trainer import MegatronTrainer
    from slime.ray.train_data import build_rank_data
    from slime.scheduling.carry import CarryBuffer

    args = parse_args([
        "--hf-checkpoint", ckpt, "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
        "--global-batch-size", "4", "--num-rollout", "4", "--rollout-num-gpus", "1", "--actor-num-gpus-per-node", "1",
        "--lr", "1e-3", "--entropy-coef", "0.01", "--bf16",
    ])  # fmt: skip
    trainer = MegatronTrainer(args, 0, 1, "127.0.0.1", port)
    assert trainer.optimizer.config.use_distributed_optimizer

    def data(rollout_id: int) -> dict:
        rank_data, _ = build_rank_data(
            args,
            rollout_id,
            _samples(trainer.spec.vocab_size, rollout_id),
            CarryBuffer(),
            {"dp_size": 1, "cp_size": 1},
        )
        return rank_data[0]

    out = Path(out_dir)
    path = out / "ckpt"
    subs = getattr(trainer.optimizer, "chained_optimizers", None) or [trainer.optimizer]

    def adam_steps() -> list[float]:
        return sorted({float(st["step"]) for o in subs for st in o.optimizer.state.values() if "step" in st})

    if phase == "save":
        trainer.train(0, data(0))
        path.mkdir()
        checkpoint.save_trainer_state(trainer, str(path), rollout_id=0)
        saved = {"state": _state(trainer), "steps": adam_steps()}
        torch.save({**saved, "loss": trainer.train(1, data(1))["train/loss"]}, out / "ref.pt")
    else:
        meta = checkpoint.load_trainer_state(trainer, str(path))
        ref = torch.load(out / "ref.pt")
        state = _state(trainer)
        diffs = {
            k: max(float((state[n][k] - ref["state"][n][k]).abs().max()) for n in state)
            for k in ("model", "param", "exp_avg", "exp_avg_sq")
        }
        steps = [adam_steps(), ref["steps"]]
        loss = trainer.train(1, data(1))["train/loss"]
        (out / "result.json").write_text(json.dumps({"diffs": diffs, "steps": steps, "loss": [loss, ref["loss"]],
                                                     "meta": meta["distributed_optimizer"]}))  # fmt: skip


def test_bf16_distributed_optimizer_round_trip(tmp_path):
    import torch.multiprocessing as mp

    from sim.tiny_checkpoint import build_tiny_checkpoint

    ckpt = str(build_tiny_checkpoint(tmp_path / "model", hidden_size=128))
    mp.spawn(_worker, args=("save", ckpt, str(tmp_path), find_free_port()), nprocs=1)
    mp.spawn(_worker, args=("load", ckpt, str(tmp_path), find_free_port()), nprocs=1)
    r = json.loads((tmp_path / "result.json").read_text())
    assert r["meta"] is True
    assert r["diffs"] == {"model": 0.0, "param": 0.0, "exp_avg": 0.0, "exp_avg_sq": 0.0}, r
    # 8 samples, each its own group (group_id=i), 4 groups per step: rollout 0 took two optimizer steps.
    assert r["steps"] == [[2.0], [2.0]], r
    assert abs(r["loss"][0] - r["loss"][1]) < 1e-6, r
