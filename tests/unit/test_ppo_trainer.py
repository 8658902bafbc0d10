"""The PPO trainers on real megatron-core (one CPU/gloo rank): critic and actor built from their role args.

One spawned rank builds the critic from an HF checkpoint that carries a value head (`score.weight`), then the
actor, both from `--megatron-config` role args with different learning rates. On a rollout with a fan-out group
the critic returns one old value per response token and trains on the value loss; the actor trains on GAE
advantages with those values. The optimizers' learning rates are read back, and both trainers' offload ledgers
(default and `--legacy-offload`) are checked against the byte rule of slime/backends/megatron/offload.py.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from sim.rank_spawn import spawn_ranks
from slime.utils.http_utils import find_free_port

pytestmark = [pytest.mark.cpu, pytest.mark.slow]

SHIM = "sim.fake_megatron.cpu_shim.apply"


def _samples(vocab: int):
    from slime.utils.types import Sample, Status

    rng = random.Random(0)
    out = []
    for i in range(8):
        r = rng.randint(2, 6)
        gid = 100 if i in (2, 3) else i  # samples 2 and 3: two segments of one trajectory
        tokens = [rng.randrange(3, vocab) for _ in range(rng.randint(4, 8) + r)]
        out.append(Sample(group_index=i // 2, index=i, group_id=gid, tokens=tokens, response_length=r,
                          reward=rng.random(), status=Status.COMPLETED))  # fmt: skip
    return out


def _worker(rank: int, port: int, ckpt: str, config: str, out: str) -> None:
    import torch

    from slime.arguments import parse_args
    from slime.backends.megatron.critic import CriticTrainer, ValueHead
    from slime.backends.megatron.hf_weights import unwrap_model
    from slime.backends.megatron.offload import TrainOffloader
    from slime.backends.megatron.roles import role_args
    from slime.backends.megatron.trainer import MegatronTrainer
    from slime.ray.train_data import build_rank_data
    from slime.scheduling.carry import CarryBuffer

    torch.set_num_threads(1)
    res: dict = {}
    args = parse_args([
        "--hf-checkpoint", ckpt, "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
        "--global-batch-size", "7", "--num-rollout", "1", "--rollout-num-gpus", "1", "--actor-num-gpus-per-node", "1",
        "--advantage-estimator", "ppo", "--megatron-config", config, "--custom-megatron-init-path", SHIM,
        "--colocate",
    ])  # fmt: skip
    res["offload_train"] = args.offload_train
    trainers = {}
    for role, cls in (("critic", CriticTrainer), ("actor", MegatronTrainer)):
        off = TrainOffloader(True)
        trainers[role] = cls(role_args(args, role), rank, 1, "127.0.0.1", port, offloader=off)
        off.attach(trainers[role].model, trainers[role].optimizer)
    critic, actor = trainers["critic"], trainers["actor"]
    head = unwrap_model(critic.model).output_layer
    res["head_is_value_head"] = isinstance(head, ValueHead)
    res["head_weight0"] = float(head.weight[0, 0])
    samples = _samples(actor.spec.vocab_size)
    data, _ = build_rank_data(args, 0, samples, CarryBuffer(), {"dp_size": 1, "cp_size": 1})
    critic.offloader.sleep()
    critic.offloader.wake_up()
    c_metrics, values = critic.train_rollout(0, data[0])
    res["critic_metrics"] = c_metrics
    res["value_lengths"] = [len(v) for v in values]
    res["response_lengths"] = data[0]["response_lengths"]
    res["rewards"] = data[0]["rewards"]
    res["next_segments"] = data[0]["next_segments"]
    res["batch_positions"] = data[0]["batch_positions"]
    a_metrics = actor.train(0, data[0], values)
    res["actor_metrics"] = a_metrics
    res["lr"] = {"actor": actor.optimizer.param_groups[0]["lr"], "critic": critic.optimizer.param_groups[0]["lr"]}
    # byte ledgers: the same trainer asleep under each policy
    res["ledger"] = {}
    for legacy in (False, True):
        off = TrainOffloader(True, legacy=legacy)
        actor.offloader = off
        off.attach(actor.model, actor.optimizer)
        before = {n: p.detach().clone() for n, p in actor.model.named_parameters()}
        off.sleep()
        exported = {n: t.clone() for n, t in actor.export_hf()}
        off.wake_up()
        res["ledger"]["legacy" if legacy else "default"] = {
            "calls": off.calls,
            "host_asleep": sum(h for step, _, _, h in off.ledger.entries if not step.startswith(("resume", "restore", "zero"))),  # fmt: skip
            "params": off.param_bytes, "grads": off.grad_bytes, "optimizer": off.optimizer_bytes,
            "restored": all(torch.equal(before[n], p) for n, p in actor.model.named_parameters()),
            "exported": len(exported),
        }  # fmt: skip
    res["numel"] = sum(p.numel() for p in actor.model.parameters())
    # the memory plan's count and host bytes for this very trainer (fp32, plain optimizer: the CPU defaults)
    from slime.backends.megatron.memory import MemoryConfig, ModelShape, build_memory_plan, params_per_rank

    shape = ModelShape.of(actor.spec)
    res["plan_numel"] = {"actor": params_per_rank(shape, 1, 1, 0),
                         "critic": params_per_rank(ModelShape.of(critic.spec), 1, 1, 0, critic=True)}  # fmt: skip
    res["critic_numel"] = sum(p.numel() for p in critic.model.parameters())
    res["plan_host_asleep"] = {}
    for policy in ("v0.3.0", "legacy"):
        cfg = MemoryConfig(actor=shape, bf16=False, distributed_optimizer=False, policy=policy, colocated=False)
        res["plan_host_asleep"][policy] = build_memory_plan(cfg).stages[0].phase("rollout").host_total
    Path(out).write_text(json.dumps(res))


def _checkpoint_with_value_head(src: Path, dst: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    for f in src.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copy(f, dst / f.name)
    tensors = load_file(src / "model.safetensors")
    hidden = json.loads((src / "config.json").read_text())["hidden_size"]
    tensors["score.weight"] = torch.full((1, hidden), 0.25)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})


def test_critic_and_actor_from_role_args(tmp_path):
    from sim.tiny_checkpoint import build_tiny_checkpoint

    ckpt = build_tiny_checkpoint(tmp_path / "model")
    critic_ckpt = tmp_path / "critic_hf"
    _checkpoint_with_value_head(ckpt, critic_ckpt)
    config = tmp_path / "roles.yaml"
    config.write_text(
        "megatron:\n"
        "  - {name: default, role: actor, overrides: {lr: 1e-3}}\n"
        f"  - {{name: default, role: critic, overrides: {{lr: 5e-3, hf_checkpoint: {critic_ckpt}}}}}\n"
    )
    out = tmp_path / "res.json"
    spawn_ranks(_worker, args=(find_free_port(), str(ckpt), str(config), str(out)), nprocs=1)
    r = json.loads(out.read_text())
    assert r["offload_train"]
    assert r["head_is_value_head"] and r["head_weight0"] == 0.25  # the checkpoint's head, not a fresh one
    assert r["value_lengths"] == r["response_lengths"]
    assert r["lr"] == {"actor": 1e-3, "critic": 5e-3}  # YAML's "1e-3" is a string to YAML: coerced to float
    cm, am = r["critic_metrics"], r["actor_metrics"]
    assert cm["critic/lr"] == 5e-3 and am["train/lr"] == 1e-3
    assert cm["critic/value_loss"] > 0 and 0.0 <= cm["critic/value_clipfrac"] <= 1.0
    assert cm["critic/update_successful"] == 1.0 and am["train/update_successful"] == 1.0
    assert all(k.startswith(("critic/", "time/", "memory/")) for k in cm), sorted(cm)
    # the fan-out trajectory: its first segment points at its second, which alone carries the reward
    (first,) = [k for k, n in enumerate(r["next_segments"]) if n >= 0]
    second = r["batch_positions"].index(r["next_segments"][first])
    assert r["rewards"][first] == 0.0 and r["rewards"][second] > 0.0
    # offload: both policies restore the weights; the default keeps (param bytes + 4) per param less on the host
    d, legacy = r["ledger"]["default"], r["ledger"]["legacy"]
    assert d["restored"] and legacy["restored"] and d["exported"] == legacy["exported"] > 0
    assert d["calls"] == ["release:grads", "pause:optimizer", "copy_params_to_pinned", "release:params",
                          "resume:optimizer", "restore_params", "zero_grads"]  # fmt: skip
    assert legacy["calls"] == ["copy_params_unpinned", "pause:train", "resume:train", "restore_params"]
    assert d["params"] == 4 * r["numel"] and d["grads"] == 4 * r["numel"]  # fp32 on CPU
    assert d["host_asleep"] == d["params"] + d["optimizer"]
    assert legacy["host_asleep"] == 2 * legacy["params"] + legacy["grads"] + legacy["optimizer"]
    assert legacy["host_asleep"] - d["host_asleep"] == (4 + 4) * r["numel"]
    # the memory plan knows this trainer: its parameter count and what each policy keeps on the host
    assert r["plan_numel"] == {"actor": r["numel"], "critic": r["critic_numel"]}
    assert r["plan_host_asleep"] == {"v0.3.0": d["host_asleep"], "legacy": legacy["host_asleep"]}
