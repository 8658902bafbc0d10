"""A DP=2 checkpoint resumed with DP=1 (issue 5), with the plain and with the distributed optimizer.

Phase 1 (2 spawned ranks, DP=2, CPU/gloo): train rollout 0, save through `checkpoint.save_trainer_state`,
record the full (un-sharded) parameters and Adam moments, then train rollout 1 and record its loss.
Phase 2 (1 rank, DP=1): a fresh trainer loads the checkpoint; parameters, exp_avg and exp_avg_sq must equal
phase 1's bit for bit, the Adam step and LR schedule must continue, and training rollout 1 must give the
same loss to 1e-6 (the gradient reduction order differs between DP=2 and DP=1, so not bitwise).

The distributed optimizer on CPU needs the shim's explicit opt-in (`--use-distributed-optimizer` makes the
init hook call `cpu_shim.enable_distributed_optimizer()`). Both optimizers share each spawn.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import psutil
import pytest
import torch

from sim.rank_spawn import spawn_ranks
from slime.utils.http_utils import find_free_port

pytestmark = [pytest.mark.cpu, pytest.mark.slow]

SHIM = "sim.fake_megatron.cpu_shim.apply"
OPTIMIZERS = {"plain": "--no-use-distributed-optimizer", "distributed": "--use-distributed-optimizer"}


def _samples(vocab: int, rollout_id: int) -> list:
    from slime.utils.types import Sample, Status

    rng = random.Random(rollout_id)
    out = []
    for i in range(8):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(4, 9))]
        r = rng.randint(3, 8)
        out.append(
            Sample(group_index=i // 2, index=i, group_id=i, tokens=prompt + [rng.randrange(3, vocab) for _ in range(r)],
                   response_length=r, reward=rng.random(), status=Status.COMPLETED)
        )  # fmt: skip
    return out


def full_optimizer_state(trainer) -> dict[str, dict[str, torch.Tensor]]:
    """name -> {param, exp_avg, exp_avg_sq}, whole tensors: the distributed optimizer's shards are placed at
    their ranges and summed over DP (each element lives on exactly one rank)."""
    import torch.distributed as dist

    from slime.backends.megatron.hf_weights import unwrap_model

    subs = getattr(trainer.optimizer, "chained_optimizers", None) or [trainer.optimizer]
    out = {}
    for name, p in unwrap_model(trainer.model).named_parameters():
        full = {k: torch.zeros(p.numel()) for k in ("param", "exp_avg", "exp_avg_sq")}
        sharded = False
        for o in subs:
            if hasattr(o, "gbuf_ranges"):
                sharded = True
                for maps in o.gbuf_ranges:
                    for buckets in maps.values():
                        for m in buckets:
                            if p in m["param_map"]:
                                r = m["param_map"][p]["param"]
                                local = o._get_main_param_and_optimizer_states(p)
                                for k in full:
                                    full[k][r.start : r.end] = local[k].detach().reshape(-1)
            elif p in o.optimizer.state:
                st = o.optimizer.state[p]
                full = {"param": p.detach().reshape(-1).clone(), "exp_avg": st["exp_avg"].reshape(-1).clone(),
                        "exp_avg_sq": st["exp_avg_sq"].reshape(-1).clone()}  # fmt: skip
        if sharded:
            for k in full:
                dist.all_reduce(full[k], group=trainer.ps.group("dp"))
        out[name] = {k: v.reshape(p.shape) for k, v in full.items()}
    return out


def _adam_steps(trainer) -> list[float]:
    subs = getattr(trainer.optimizer, "chained_optimizers", None) or [trainer.optimizer]
    return sorted({float(st["step"]) for o in subs for st in o.optimizer.state.values() if "step" in st})


def _worker(rank: int, world: int, port: int, ckpt: str, out_dir: str) -> None:
    import torch.distributed as dist

    from slime.arguments import parse_args
    from slime.backends.megatron import checkpoint
    from slime.backends.megatron.hf_weights import unwrap_model
    from slime.backends.megatron.initialize import destroy_megatron
    from slime.backends.megatron.trainer import MegatronTrainer
    from slime.ray.train_data import build_rank_data
    from slime.scheduling.carry import CarryBuffer

    torch.set_num_threads(1)
    out = Path(out_dir)
    for kind, flag in OPTIMIZERS.items():
        args = parse_args([
            "--hf-checkpoint", ckpt, "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
            "--global-batch-size", "8", "--num-rollout", "4", "--rollout-num-gpus", "1",
            "--actor-num-gpus-per-node", str(world), "--lr", "1e-3", "--entropy-coef", "0.01",
            "--lr-decay-style", "linear", "--lr-warmup-iters", "1", "--custom-megatron-init-path", SHIM, flag,
        ])  # fmt: skip
        trainer = MegatronTrainer(args, rank, world, "127.0.0.1", port)
        assert trainer.optimizer.config.use_distributed_optimizer == (kind == "distributed")

        def data(rollout_id: int, trainer=trainer, args=args) -> dict:
            samples = _samples(trainer.spec.vocab_size, rollout_id)
            rank_data, _ = build_rank_data(args, rollout_id, samples, CarryBuffer(), {"dp_size": world, "cp_size": 1})
            return rank_data[trainer.ps.rank("dp")]

        path = str(out / f"ckpt_{kind}")
        if world == 2:
            trainer.train(0, data(0))
            if rank == 0:
                Path(path).mkdir()
            dist.barrier()
            checkpoint.save_trainer_state(trainer, path, rollout_id=0)
            # megatron's writer would otherwise keep a spawned Manager interpreter for its results (~3 CPU-s)
            spawned = [c.pid for c in psutil.Process().children() if "spawn_main" in " ".join(c.cmdline())]
            (out / f"spawned_{kind}_{rank}.json").write_text(json.dumps(spawned))
            state = full_optimizer_state(trainer)
            lr = trainer.optimizer.param_groups[0]["lr"]
            steps = _adam_steps(trainer)
            metrics = trainer.train(1, data(1))
            after = {n: p.detach().clone() for n, p in unwrap_model(trainer.model).named_parameters()}
            if rank == 0:
                torch.save({"state": state, "lr": lr, "steps": steps, "loss": metrics["train/loss"], "after": after},
                           out / f"ref_{kind}.pt")  # fmt: skip
        else:
            meta = checkpoint.load_trainer_state(trainer, path)
            ref = torch.load(out / f"ref_{kind}.pt")
            state = full_optimizer_state(trainer)
            diffs = {
                k: max(float((state[n][k] - ref["state"][n][k]).abs().max()) for n in state)
                for k in ("param", "exp_avg", "exp_avg_sq")
            }
            result = {
                "diffs": diffs,
                "same_names": sorted(state) == sorted(ref["state"]),
                "steps": [_adam_steps(trainer), ref["steps"]],
                "meta_dp": meta["parallel"]["dp"],
                "lr": [trainer.optimizer.param_groups[0]["lr"], ref["lr"]],
            }
            metrics = trainer.train(1, data(1))
            result["loss"] = [metrics["train/loss"], ref["loss"]]
            # the step after the resume: equal up to the DP reduction order (a wrong Adam step count or a
            # stale moment would move parameters by ~lr, i.e. 1e-3)
            params = dict(unwrap_model(trainer.model).named_parameters())
            result["after_step_diff"] = max(float((params[n] - t).abs().max()) for n, t in ref["after"].items())
            (out / f"result_{kind}.json").write_text(json.dumps(result))
        dist.barrier()
        destroy_megatron()
        port += 1  # a fresh rendezvous for the next optimizer kind


def test_dp2_checkpoint_resumes_with_dp1(tmp_path):
    from sim.tiny_checkpoint import build_tiny_checkpoint

    ckpt = str(build_tiny_checkpoint(tmp_path / "model"))
    spawn_ranks(_worker, args=(2, find_free_port(), ckpt, str(tmp_path)), nprocs=2)
    spawn_ranks(_worker, args=(1, find_free_port(), ckpt, str(tmp_path)), nprocs=1)
    for kind in OPTIMIZERS:
        assert [json.loads((tmp_path / f"spawned_{kind}_{rank}.json").read_text()) for rank in (0, 1)] == [[], []]
        r = json.loads((tmp_path / f"result_{kind}.json").read_text())
        assert r["meta_dp"] == 2 and r["same_names"]
        assert r["diffs"] == {"param": 0.0, "exp_avg": 0.0, "exp_avg_sq": 0.0}, (kind, r)
        assert r["steps"][0] == r["steps"][1] == [1.0], (kind, r["steps"])  # one step per param, not shared
        assert r["lr"][0] == r["lr"][1]
        assert r["loss"][1] != 0.0 and abs(r["loss"][0] - r["loss"][1]) < 1e-6, (kind, r["loss"])
        assert r["after_step_diff"] < 1e-6, (kind, r["after_step_diff"])


def _bf16_worker(rank: int, phase: str, ckpt: str, out_dir: str, port: int) -> None:
    """bf16 params with fp32 norm weights (the local spec's torch norms) put fp32 and bf16 params in one
    optimizer group; every optimizer slot must come back to the right parameter."""
    from slime.arguments import parse_args
    from slime.backends.megatron import checkpoint
    from slime.backends.megatron.trainer import MegatronTrainer

    args = parse_args([
        "--hf-checkpoint", ckpt, "--rollout-batch-size", "4", "--num-rollout", "4", "--rollout-num-gpus", "1",
        "--actor-num-gpus-per-node", "1", "--bf16", "--use-distributed-optimizer", "--custom-megatron-init-path", SHIM,
    ])  # fmt: skip
    trainer = MegatronTrainer(args, 0, 1, "127.0.0.1", port)
    (opt,) = trainer.optimizer.chained_optimizers[:1]
    checkpoint.allocate_optimizer_state(trainer.optimizer)
    ref_path, path = Path(out_dir) / "bf16_ref.pt", Path(out_dir) / "ckpt_bf16"
    if phase == "save":
        g = torch.Generator().manual_seed(0)
        for st in opt.optimizer.state.values():  # a distinct value in every slot: a swapped slot shows
            st["exp_avg"].copy_(torch.randn(st["exp_avg"].shape, generator=g))
            st["exp_avg_sq"].copy_(torch.rand(st["exp_avg_sq"].shape, generator=g))
            st["step"].fill_(3)
        path.mkdir()
        checkpoint.save_trainer_state(trainer, str(path), rollout_id=0)
        states = [opt._get_main_param_and_optimizer_states(p) for p in opt.model_param_group_index_map]
        torch.save([{k: v.clone() for k, v in s.items()} for s in states], ref_path)
        return
    checkpoint.load_trainer_state(trainer, str(path))
    ref = torch.load(ref_path)
    got = [opt._get_main_param_and_optimizer_states(p) for p in opt.model_param_group_index_map]
    ok = all(
        torch.equal(a[k], b[k]) for a, b in zip(got, ref, strict=True) for k in ("param", "exp_avg", "exp_avg_sq")
    )
    steps = sorted({float(s["step"]) for s in got})
    (Path(out_dir) / "bf16_result.json").write_text(json.dumps({"equal": ok, "steps": steps}))


def test_bf16_mixed_group_distributed_optimizer_round_trip(tmp_path):
    from sim.tiny_checkpoint import build_tiny_checkpoint

    ckpt = str(build_tiny_checkpoint(tmp_path / "model", hidden_size=128))
    spawn_ranks(_bf16_worker, args=("save", ckpt, str(tmp_path), find_free_port()), nprocs=1)
    spawn_ranks(_bf16_worker, args=("load", ckpt, str(tmp_path), find_free_port()), nprocs=1)
    assert json.loads((tmp_path / "bf16_result.json").read_text()) == {"equal": True, "steps": [3.0]}
