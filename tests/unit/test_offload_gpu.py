"""`--offload-train` on a GPU, both policies (offload.py: the default's pinned buffers, the legacy policy's
torch_memory_saver region): a trainer built with the offloader frees its device memory on `sleep`, weight sync
reads the host copy while asleep, and `wake_up` brings the exact parameters and optimizer state back so training
continues.
"""

from __future__ import annotations

import importlib.util
import json
import random
import time
from pathlib import Path

import pytest
import torch

from slime.utils.http_utils import find_free_port

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("torch_memory_saver") is None, reason="needs torch_memory_saver"),
]


def _worker(rank: int, ckpt: str, out: str, port: int, legacy: bool) -> None:
    from slime.arguments import parse_args
    from slime.backends.megatron.offload import TrainOffloader
    from slime.backends.megatron.trainer import MegatronTrainer
    from slime.ray.train_data import build_rank_data
    from slime.scheduling.carry import CarryBuffer
    from slime.utils.types import Sample, Status

    args = parse_args([
        "--hf-checkpoint", ckpt, "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--num-rollout", "2",
        "--actor-num-gpus-per-node", "1", "--colocate", "--lr", "1e-3", "--entropy-coef", "0.01", "--bf16",
    ])  # fmt: skip
    assert args.offload_train and args.update_weight_mode == "tensor"
    off = TrainOffloader(args.offload_train, legacy=legacy)
    assert off.backend == "torch_memory_saver"
    trainer = MegatronTrainer(args, 0, 1, "127.0.0.1", port, offloader=off)  # as TrainRayActor.init does
    off.attach(trainer.model, trainer.optimizer)
    rng = random.Random(0)
    samples = [
        Sample(group_index=i // 2, index=i, group_id=i, tokens=[rng.randrange(3, 400) for _ in range(12)],
               response_length=5, reward=rng.random(), status=Status.COMPLETED)
        for i in range(8)
    ]  # fmt: skip
    data, _ = build_rank_data(args, 0, samples, CarryBuffer(), {"dp_size": 1, "cp_size": 1})
    res: dict = {"train0": trainer.train(0, data[0])["train/update_successful"]}
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    exported_awake = {n: t.cpu().clone() for n, t in trainer.export_hf()}
    torch.cuda.synchronize()
    free_awake = torch.cuda.mem_get_info()[0]
    res["device_bytes"] = off.param_bytes + off.grad_bytes + off.optimizer_bytes
    inner = getattr(trainer.optimizer, "chained_optimizers", None) or [trainer.optimizer]
    opt_state = [v for o in inner for st in getattr(o, "optimizer", o).state.values() for v in st.values()
                 if torch.is_tensor(v) and v.dim()]  # fmt: skip
    opt_before = [v.cpu() for v in opt_state]  # on the host: a device copy would pin allocator segments
    t0 = time.perf_counter()
    off.sleep()
    res["sleep_s"] = time.perf_counter() - t0
    free_asleep, total = torch.cuda.mem_get_info()
    res["device_used_asleep_mib"] = (
        total - free_asleep
    ) / 2**20  # the whole GPU: this process alone, context included
    res["host_asleep"] = sum(off.ledger.host.values())
    from slime.backends.megatron.memory import MemoryConfig, ModelShape, build_memory_plan

    cfg = MemoryConfig(actor=ModelShape.of(trainer.spec), bf16=True, distributed_optimizer=True, colocated=False,
                       policy="legacy" if legacy else "v0.3.0")  # fmt: skip
    res["plan_host_asleep"] = build_memory_plan(cfg).stages[0].phase("rollout").host_total
    exported_asleep = {n: t.cpu().clone() for n, t in trainer.export_hf()}
    t0 = time.perf_counter()
    off.wake_up()
    res["wake_s"] = time.perf_counter() - t0
    res["optimizer_restored"] = bool(opt_state) and all(
        torch.equal(a, b.cpu()) for a, b in zip(opt_before, opt_state, strict=True)
    )
    res["freed_mib"] = (free_asleep - free_awake) / 2**20
    res["export_equal"] = all(torch.equal(exported_awake[n], exported_asleep[n]) for n in exported_awake)
    res["params_restored"] = all(torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    res["train1"] = trainer.train(1, data[0])["train/update_successful"]
    res["events"] = [e for _, e in off.events]
    Path(out).write_text(json.dumps(res))


@pytest.mark.parametrize("legacy", [False, True])
def test_sleep_frees_memory_and_wake_restores(tmp_path, legacy):
    import torch.multiprocessing as mp

    from sim.tiny_checkpoint import build_tiny_checkpoint

    ckpt = str(build_tiny_checkpoint(tmp_path / "model", hidden_size=256, num_layers=4, intermediate_size=1024))
    out = tmp_path / "res.json"
    mp.spawn(_worker, args=(ckpt, str(out), find_free_port(), legacy), nprocs=1)
    r = json.loads(out.read_text())
    assert r["train0"] == 1.0 and r["train1"] == 1.0
    assert r["events"] == ["sleep", "wake_up"]
    assert r["export_equal"] and r["params_restored"] and r["optimizer_restored"], r  # bit-identical round trip
    assert r["freed_mib"] * 2**20 > 0.9 * r["device_bytes"], r  # params, grads and optimizer state left the GPU
    # the ledger books what the memory plan predicts (megatron pads its buffers by a few elements per param)
    assert abs(r["host_asleep"] / r["plan_host_asleep"] - 1) < 0.01, r
