"""MoE stacks with dense layers (HF's `mlp_only_layers` / `decoder_sparse_step`): Qwen3-MoE with its first layer
dense and Qwen2-MoE (shared expert + gate) with its middle layer dense give HF's logits through megatron-core's
per-layer `moe_layer_freq` pattern, packed rows give the single-sample logits, and HF → mcore → HF returns every
tensor bit for bit (the dense layer's plain MLP included), at EP=1 and EP=2 (2 gloo ranks, one spawn).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from sim.rank_spawn import spawn_ranks
from sim.tiny_checkpoint import build_random_moe
from slime.utils.http_utils import find_free_port

pytestmark = [pytest.mark.cpu, pytest.mark.slow]

SHIM = "sim.fake_megatron.cpu_shim.apply"
VARIANTS = {  # name -> (model_type, dense layers of 3)
    "qwen3_moe_first_dense": ("qwen3_moe", (0,)),
    "qwen2_moe_middle_dense": ("qwen2_moe", (1,)),
}
PHASES = {"ep1": 1, "ep2": 2}
LENGTHS = [7, 3, 12, 5]


def _worker(rank: int, world: int, port: int, ckpts: dict[str, str], out_dir: str) -> None:
    from megatron.core import parallel_state as mpu
    from transformers import AutoModelForCausalLM

    from slime.arguments import default_args
    from slime.backends.megatron import hf_weights, packing
    from slime.backends.megatron.hf_config import read_hf_config
    from slime.backends.megatron.initialize import destroy_megatron, init_distributed, init_megatron
    from slime.backends.megatron.model_provider import build_gpt_model

    torch.set_num_threads(1)
    args = default_args(custom_megatron_init_path=SHIM, seed=1234)
    init_distributed(args, rank, world, "127.0.0.1", port)
    res: dict = {}
    for phase, ep in PHASES.items():
        args.expert_model_parallel_size = ep
        ps = init_megatron(args)
        res[phase] = {}
        for name, path in ckpts.items():
            spec = read_hf_config(path)
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            model = build_gpt_model(args, spec).eval()
            hf_weights.load_hf_weights(model, path, spec, ps)
            g = torch.Generator().manual_seed(7)
            seqs = [torch.randint(0, spec.vocab_size, (n,), generator=g) for n in LENGTHS]
            with torch.no_grad():
                ref = [hf(s[None]).logits[0] for s in seqs]
                single = [model(s[None], torch.arange(len(s))[None], None)[0, :, : spec.vocab_size] for s in seqs]
                packed = packing.pack_samples(seqs, pad_multiple=8)
                out = model(packed.tokens, packed.position_ids, None, packed_seq_params=packed.packed_seq_params)
                per = packing.unpack_logits(out[..., : spec.vocab_size], packed)
            params = [n for n, _ in model.named_parameters()]
            res[phase][name] = {
                "hf_vs_mcore": max((a - b).abs().max().item() for a, b in zip(ref, single, strict=True)),
                "packed_vs_single": max((a - b).abs().max().item() for a, b in zip(per, single, strict=True)),
                "logit_scale": max(a.abs().max().item() for a in ref),
                "moe_layers": sorted({int(n.split(".")[2]) for n in params if ".mlp.router." in n}),
                "dense_layers": sorted({int(n.split(".")[2]) for n in params if n.endswith("mlp.linear_fc1.weight")}),
            }
            exported = dict(hf_weights.export_hf_weights(model, spec, ps))
            if rank == 0:
                torch.save(exported, os.path.join(out_dir, f"{phase}_{name}.pt"))
        mpu.destroy_model_parallel()
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    destroy_megatron()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from safetensors.torch import load_file

    root = tmp_path_factory.mktemp("moe_dense_layers")
    ckpts = {}
    for name, (model_type, dense) in VARIANTS.items():
        build_random_moe(root / name, model_type, num_layers=3, mlp_only_layers=dense)
        ckpts[name] = str(root / name)
    spawn_ranks(_worker, args=(2, find_free_port(), ckpts, str(root)), nprocs=2, daemon=True)
    return {
        "ranks": [torch.load(root / f"rank{r}.pt") for r in range(2)],
        "exports": {f.stem: torch.load(f) for f in Path(root).glob("ep*_*.pt")},
        "hf": {name: load_file(os.path.join(path, "model.safetensors")) for name, path in ckpts.items()},
    }


@pytest.mark.parametrize("phase", list(PHASES))
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_dense_layers_in_an_moe_stack_match_hf(results, phase, variant):
    dense = list(VARIANTS[variant][1])
    for rank in results["ranks"]:
        r = rank[phase][variant]
        assert r["dense_layers"] == dense and r["moe_layers"] == [i for i in range(3) if i not in dense], r
        assert r["logit_scale"] > 0.5
        assert r["hf_vs_mcore"] <= 1e-5, r
        assert r["packed_vs_single"] <= 1e-5, r


@pytest.mark.parametrize("phase", list(PHASES))
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_dense_layers_round_trip_bit_exact(results, phase, variant):
    hf, got = results["hf"][variant], results["exports"][f"{phase}_{variant}"]
    assert set(got) == set(hf)
    dense = VARIANTS[variant][1][0]
    assert f"model.layers.{dense}.mlp.gate_proj.weight" in got  # the dense layer's plain MLP
    for name, tensor in got.items():
        assert torch.equal(tensor, hf[name]), name
