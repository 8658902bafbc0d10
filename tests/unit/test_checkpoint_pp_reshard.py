"""Resume across pipeline layouts: a checkpoint saved at PP=2 loads at PP=1 and at TP=2 with identical parameters
and Adam moments (bit for bit, compared as full HF-named tensors), the same Adam step and learning rate.

Phase 1 (2 spawned ranks, PP=2, CPU/gloo): train rollout 0, save through `checkpoint.save_trainer_state`, and
write each stage's parameters and moments under HF names. Phase 2 loads that checkpoint at PP=1 (1 rank) and
at TP=2 (2 ranks) and writes the same tensors, gathered over TP.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from sim.rank_spawn import spawn_ranks
from slime.utils.http_utils import find_free_port

pytestmark = [pytest.mark.cpu, pytest.mark.slow]

SHIM = "sim.fake_megatron.cpu_shim.apply"
LAYOUTS = {"pp2": (2, 1, 2), "pp1": (1, 1, 1), "tp2": (2, 2, 1)}  # name -> (processes, tp, pp)


def _samples(vocab: int) -> list:
    from slime.utils.types import Sample, Status

    rng = random.Random(0)
    out = []
    for i in range(8):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(4, 9))]
        r = rng.randint(3, 8)
        out.append(
            Sample(group_index=i // 2, index=i, group_id=i, tokens=prompt + [rng.randrange(3, vocab) for _ in range(r)],
                   response_length=r, reward=rng.random(), status=Status.COMPLETED)
        )  # fmt: skip
    return out


def _hf_state(trainer) -> dict[str, dict[str, torch.Tensor]]:
    """kind -> HF name -> full tensor, for this stage's parameters and their Adam moments (gathered over TP)."""
    from slime.backends.megatron.hf_weights import iter_hf_tensors, layer_offset, unwrap_model

    module = unwrap_model(trainer.model)
    state = trainer.optimizer.optimizer.state
    named = list(module.named_parameters())
    out = {}
    for kind in ("param", "exp_avg", "exp_avg_sq"):
        tensors = [(n, p.detach() if kind == "param" else state[p][kind]) for n, p in named]
        out[kind] = {n: t.clone() for n, t in iter_hf_tensors(tensors, trainer.spec, trainer.ps, layer_offset(module))}
    out["step"] = sorted({float(st["step"]) for st in state.values()})
    out["lr"] = trainer.optimizer.param_groups[0]["lr"]
    return out


def _worker(rank: int, name: str, port: int, ckpt: str, out_dir: str) -> None:
    import torch.distributed as dist

    from slime.arguments import parse_args
    from slime.backends.megatron import checkpoint
    from slime.backends.megatron.initialize import destroy_megatron
    from slime.backends.megatron.trainer import MegatronTrainer
    from slime.ray.train_data import build_rank_data
    from slime.scheduling.carry import CarryBuffer

    torch.set_num_threads(1)
    world, tp, pp = LAYOUTS[name]
    args = parse_args([
        "--hf-checkpoint", ckpt, "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
        "--global-batch-size", "8", "--num-rollout", "4", "--rollout-num-gpus", "1",
        "--actor-num-gpus-per-node", str(world), "--lr", "1e-3", "--entropy-coef", "0.01",
        "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
        "--custom-megatron-init-path", SHIM, "--no-use-distributed-optimizer",
    ])  # fmt: skip
    trainer = MegatronTrainer(args, rank, world, "127.0.0.1", port)
    path = str(Path(out_dir) / "ckpt")
    if name == "pp2":
        data, _ = build_rank_data(args, 0, _samples(trainer.spec.vocab_size), CarryBuffer(), {"dp_size": 1})
        trainer.train(0, data[0])
        if rank == 0:
            Path(path).mkdir()
        dist.barrier()
        checkpoint.save_trainer_state(trainer, path, rollout_id=0)
    else:
        checkpoint.load_trainer_state(trainer, path)
    state = _hf_state(trainer)
    if trainer.ps.rank("tp") == 0:
        torch.save(state, Path(out_dir) / f"{name}.pp{trainer.ps.rank('pp')}.pt")
    dist.barrier()
    destroy_megatron()


def _merged(out: Path, name: str) -> dict:
    stages = [torch.load(out / f"{name}.pp{k}.pt") for k in range(LAYOUTS[name][2])]
    merged = {
        kind: {n: t for st in stages for n, t in st[kind].items()} for kind in ("param", "exp_avg", "exp_avg_sq")
    }
    return {**merged, "step": stages[0]["step"], "lr": stages[0]["lr"]}


def test_pp2_checkpoint_loads_at_pp1_and_tp2_identically(tmp_path):
    from sim.tiny_checkpoint import build_tiny_checkpoint

    ckpt = str(build_tiny_checkpoint(tmp_path / "model"))
    for name, (world, _, _) in LAYOUTS.items():
        spawn_ranks(
            _worker, args=(name, find_free_port(), ckpt, str(tmp_path)), nprocs=world
        )  # not daemonic: the checkpoint writer starts helpers
    want = _merged(tmp_path, "pp2")
    assert want["step"] == [1.0] and float(want["exp_avg_sq"]["model.norm.weight"].abs().max()) > 0
    for name in ("pp1", "tp2"):
        got = _merged(tmp_path, name)
        assert got["step"] == want["step"] and got["lr"] == want["lr"], name
        for kind in ("param", "exp_avg", "exp_avg_sq"):
            assert set(got[kind]) == set(want[kind]), (name, kind, set(got[kind]) ^ set(want[kind]))
            for n, t in want[kind].items():
                assert torch.equal(got[kind][n], t), (name, kind, n)
