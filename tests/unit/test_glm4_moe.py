"""GLM-4.5-style MoE (`glm4_moe`): partial rotary (0.5), the first layer dense, q/k/v biases, two ungated shared
experts, a sigmoid router whose `e_score_correction_bias` chooses the experts but not their weights, renormalised
top-k weights times `routed_scaling_factor` — as HF's Glm4MoeTopkRouter defines them. A tiny random checkpoint
built with transformers (the bias random too, so it changes routing) gives HF's logits through megatron-core
within 1e-5 in fp32, packed rows the single-sample logits, and HF → mcore → HF returns every tensor bit for bit,
the routing bias included, at EP=1 and EP=2 (2 gloo ranks, one spawn). Negative control: HF with the bias zeroed
differs from what megatron computes.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from sim.rank_spawn import spawn_ranks
from slime.utils.http_utils import find_free_port

pytestmark = [pytest.mark.cpu, pytest.mark.slow]

SHIM = "sim.fake_megatron.cpu_shim.apply"
VARIANTS = {"glm4_moe": ("glm4_moe", (0,))}  # name -> (model_type, dense layers of 3)


def build_random_glm4_moe(out: Path) -> None:
    import transformers

    cfg = transformers.Glm4MoeConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, partial_rotary_factor=0.5, attention_bias=True,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=2, first_k_dense_replace=1, n_group=1,
        topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5, max_position_embeddings=256,
        tie_word_embeddings=False, use_qk_norm=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Glm4MoeForCausalLM(cfg).float()
    with torch.no_grad():  # larger than HF's init; the routing bias too, so it changes which experts are chosen
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn_like(b))
    model.save_pretrained(out)


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
            for name_, b in hf.named_buffers():  # the negative control: HF without its routing bias
                if name_.endswith("e_score_correction_bias"):
                    b.zero_()
            with torch.no_grad():
                unbiased = [hf(s[None]).logits[0] for s in seqs]
            res[phase][name] = {
                "hf_vs_mcore": max((a - b).abs().max().item() for a, b in zip(ref, single, strict=True)),
                "packed_vs_single": max((a - b).abs().max().item() for a, b in zip(per, single, strict=True)),
                "logit_scale": max(a.abs().max().item() for a in ref),
                "without_bias_gap": max((a - b).abs().max().item() for a, b in zip(unbiased, single, strict=True)),
                "rotary_percent": spec.rotary_percent,
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
    for name in VARIANTS:
        build_random_glm4_moe(root / name)
        ckpts[name] = str(root / name)
    spawn_ranks(_worker, args=(2, find_free_port(), ckpts, str(root)), nprocs=2, daemon=True)
    return {
        "ranks": [torch.load(root / f"rank{r}.pt") for r in range(2)],
        "exports": {f.stem: torch.load(f) for f in Path(root).glob("ep*_*.pt")},
        "hf": {name: load_file(os.path.join(path, "model.safetensors")) for name, path in ckpts.items()},
    }


@pytest.mark.parametrize("phase", list(PHASES))
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_glm4_moe_matches_hf(results, phase, variant):
    dense = list(VARIANTS[variant][1])
    for rank in results["ranks"]:
        r = rank[phase][variant]
        assert r["dense_layers"] == dense and r["moe_layers"] == [i for i in range(3) if i not in dense], r
        assert r["logit_scale"] > 0.5
        assert r["hf_vs_mcore"] <= 1e-5, r
        assert r["packed_vs_single"] <= 1e-5, r
        assert r["without_bias_gap"] > 1e-3, r  # the routing bias matters, and megatron applies it
        assert r["rotary_percent"] == 0.5


@pytest.mark.parametrize("phase", list(PHASES))
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_glm4_moe_round_trip_bit_exact(results, phase, variant):
    hf, got = results["hf"][variant], results["exports"][f"{phase}_{variant}"]
    assert set(got) == set(hf)
    dense = VARIANTS[variant][1][0]
    assert f"model.layers.{dense}.mlp.gate_proj.weight" in got  # the dense layer's plain MLP
    assert (
        "model.layers.1.mlp.gate.e_score_correction_bias" in got
        and "model.layers.1.mlp.shared_experts.up_proj.weight" in got
    )
    for name, tensor in got.items():
        assert torch.equal(tensor, hf[name]), name
