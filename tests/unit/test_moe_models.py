"""MoE models through real megatron-core on CPU over gloo (2 processes): Qwen3-MoE and Qwen2-MoE (shared expert
with its gate) from their HF config give HF's logits, packed rows give the single-sample logits, and HF → mcore →
HF returns every tensor bit for bit, in four layouts: EP=1 (each rank the whole model), EP=2 (2 local experts per
rank), TP=2 (experts split over ETP=2), and TP=2 × EP=2 with ETP=1.

One spawn of 2 ranks (`sim/rank_spawn.py`) runs the four phases; each rank
writes its measurements to a file and the tests assert on them.
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
# Qwen3-MoE renormalises its top-k weights (megatron: softmax after top-k), Qwen2-MoE does not (softmax before)
VARIANTS = {
    "qwen3_moe": dict(norm_topk_prob=True),
    "qwen2_moe": dict(norm_topk_prob=False, tie_word_embeddings=True),
}
# name -> (tp, ep, etp); 2 processes each
PHASES = {"ep1": (1, 1, None), "ep2": (1, 2, None), "tp2": (2, 1, None), "tp2ep2": (2, 2, 1)}
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
    for phase, (tp, ep, etp) in PHASES.items():
        args.tensor_model_parallel_size, args.expert_model_parallel_size = tp, ep
        args.expert_tensor_parallel_size = etp
        ps = init_megatron(args)
        res[phase] = {"layout": {d: ps.size(d) for d in ("tp", "ep", "etp", "dp")}}
        for name, path in ckpts.items():
            spec = read_hf_config(path)
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            model = build_gpt_model(args, spec).eval()
            hf_weights.load_hf_weights(model, path, spec, ps)
            g = torch.Generator().manual_seed(7)
            seqs = [torch.randint(0, spec.vocab_size, (n,), generator=g) for n in LENGTHS]

            def full(shard: torch.Tensor, vocab: int = spec.vocab_size, ps=ps) -> torch.Tensor:
                return torch.cat(ps.all_gather(shard, "tp"), dim=-1)[..., :vocab]

            with torch.no_grad():
                ref = [hf(s[None]).logits[0] for s in seqs]
                single = [full(model(s[None], torch.arange(len(s))[None], None)[0]) for s in seqs]
                packed = packing.pack_samples(seqs, pad_multiple=8)
                out = model(packed.tokens, packed.position_ids, None, packed_seq_params=packed.packed_seq_params)
                per = packing.unpack_logits(full(out), packed)
            experts = [n for n, _ in model.named_parameters() if ".local_experts." in n and "layers.0." in n]
            res[phase][name] = {
                "hf_vs_mcore": max((a - b).abs().max().item() for a, b in zip(ref, single, strict=True)),
                "packed_vs_single": max((a - b).abs().max().item() for a, b in zip(per, single, strict=True)),
                "logit_scale": max(a.abs().max().item() for a in ref),
                "local_expert_params": len(experts),
                "fc1_shape": tuple(dict(model.named_parameters())[experts[0]].shape),
            }
            exported = list(hf_weights.export_hf_weights(model, spec, ps))
            res[phase][name]["exported_names"] = [n for n, _ in exported]
            if rank == 0:
                torch.save(dict(exported), os.path.join(out_dir, f"{phase}_{name}.pt"))
        mpu.destroy_model_parallel()
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    destroy_megatron()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from safetensors.torch import load_file

    root = tmp_path_factory.mktemp("moe_models")
    ckpts = {}
    for name, kw in VARIANTS.items():
        build_random_moe(root / name, name, **kw)
        ckpts[name] = str(root / name)
    spawn_ranks(_worker, args=(2, find_free_port(), ckpts, str(root)), nprocs=2, daemon=True)
    return {
        "ranks": [torch.load(root / f"rank{r}.pt") for r in range(2)],
        "exports": {f.stem: torch.load(f) for f in Path(root).glob("*_qwen*_moe.pt")},
        "hf": {name: load_file(os.path.join(path, "model.safetensors")) for name, path in ckpts.items()},
    }


def test_phases_are_the_layouts_they_claim(results):
    want = {
        "ep1": {"tp": 1, "ep": 1, "etp": 1, "dp": 2},
        "ep2": {"tp": 1, "ep": 2, "etp": 1, "dp": 2},
        "tp2": {"tp": 2, "ep": 1, "etp": 2, "dp": 1},
        "tp2ep2": {"tp": 2, "ep": 2, "etp": 1, "dp": 1},
    }
    for rank in results["ranks"]:
        for phase, layout in want.items():
            assert rank[phase]["layout"] == layout, phase
            for name in VARIANTS:  # 4 experts, fc1 and fc2 each: 8 tensors at EP=1, 4 at EP=2
                r = rank[phase][name]
                assert r["local_expert_params"] == 2 * 4 // layout["ep"], (phase, name)
                assert r["fc1_shape"] == (2 * 32 // layout["etp"], 64), (phase, name)


@pytest.mark.parametrize("phase", list(PHASES))
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_moe_gptmodel_matches_hf(results, phase, variant):
    for rank in results["ranks"]:
        r = rank[phase][variant]
        assert r["logit_scale"] > 0.5  # not a comparison of near-zero logits
        assert r["hf_vs_mcore"] <= 1e-4, r
        assert r["packed_vs_single"] <= 1e-5, r


@pytest.mark.parametrize("phase", list(PHASES))
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_moe_hf_mcore_hf_roundtrip_is_bit_exact(results, phase, variant):
    hf, got = results["hf"][variant], results["exports"][f"{phase}_{variant}"]
    tied = VARIANTS[variant].get("tie_word_embeddings", False)
    assert set(got) == (set(hf) - {"lm_head.weight"} if tied else set(hf))
    assert sum(".mlp.experts." in n for n in got) == 2 * 4 * 3  # layers x experts x (gate, up, down)
    if variant == "qwen2_moe":
        assert sum(".mlp.shared_expert" in n for n in got) == 2 * 4  # gate/up/down + the sigmoid gate
    for name, tensor in got.items():
        assert torch.equal(tensor, hf[name]), name
    names = [rank[phase][variant]["exported_names"] for rank in results["ranks"]]
    assert names[0] == names[1]  # every rank yields every expert, in the same order
    assert len(names[0]) == len(set(names[0]))
