"""Scaled RoPE (`linear`, `dynamic`, `yarn`, `llama3`): a megatron-core GPTModel built from the HF config gives
HF's logits in fp32 on CPU (≤ 1e-5), at positions past the original context, for single samples and packed rows.

Llama-3.1-style (llama3, original context 16 of 64), Qwen2.5-style (yarn, whose attention factor scales cos/sin),
linear, and dynamic NTK, whose frequencies follow the forward's longest position: a packed row is compared with
HF's padded batch of the same samples (HF's own rule: max(position_ids) + 1 over the batch). One rank (gloo),
one spawn; the worker writes its numbers to a file and the tests assert on them.
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
LENGTHS = [40, 10, 25]  # 40 and 25 run past every original context below
VARIANTS = {
    "llama31_llama3": ("LlamaConfig", 64, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    "qwen25_yarn": ("Qwen2Config", 64, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}),
    "llama_linear": ("LlamaConfig", 16, {"rope_type": "linear", "factor": 2.0}),
    "llama_dynamic": ("LlamaConfig", 16, {"rope_type": "dynamic", "factor": 2.0}),
}  # fmt: skip


def _build(out: Path, cls_name: str, max_pos: int, rope: dict) -> None:
    import transformers

    cfg = getattr(transformers, cls_name)(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=max_pos, tie_word_embeddings=False,
        rope_parameters={"rope_theta": 10000.0, **rope},
    )  # fmt: skip
    torch.manual_seed(0)
    model = getattr(transformers, cls_name.replace("Config", "ForCausalLM"))(cfg).float()
    with torch.no_grad():  # larger than HF's init so the logits are far from constant
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p)) if "norm" in name else p.normal_(0.0, 0.1)
    model.save_pretrained(out)


def _default_rope_gap(args, spec, path, ps, seqs, ref) -> float:
    """The negative control: the same weights with unscaled RoPE, against HF's logits."""
    import dataclasses

    from slime.backends.megatron import hf_weights
    from slime.backends.megatron.model_provider import build_gpt_model

    plain = dataclasses.replace(spec, rope_type="default", rope_fields="")
    model = build_gpt_model(args, plain).eval()
    hf_weights.load_hf_weights(model, path, plain, ps)
    with torch.no_grad():
        out = [model(s[None], torch.arange(len(s))[None], None)[0, :, : spec.vocab_size] for s in seqs]
    return max((a - b).abs().max().item() for a, b in zip(ref, out, strict=True))


def _worker(rank: int, world: int, port: int, ckpts: dict[str, str], out_dir: str) -> None:
    from transformers import AutoModelForCausalLM

    from slime.arguments import default_args
    from slime.backends.megatron import hf_weights, packing
    from slime.backends.megatron.hf_config import read_hf_config
    from slime.backends.megatron.initialize import destroy_megatron, init_distributed, init_megatron
    from slime.backends.megatron.model_provider import build_gpt_model

    torch.set_num_threads(1)
    args = default_args(custom_megatron_init_path=SHIM, seed=1234)
    init_distributed(args, rank, world, "127.0.0.1", port)
    ps = init_megatron(args)
    res = {}
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
            # HF's padded batch of the same samples (right padding, masked): its forward's longest position is 40
            batch = torch.zeros(len(seqs), max(LENGTHS), dtype=torch.long)
            mask = torch.zeros_like(batch)
            for i, s in enumerate(seqs):
                batch[i, : len(s)], mask[i, : len(s)] = s, 1
            hf_batch = hf(batch, attention_mask=mask).logits
            ref_batch = [hf_batch[i, : len(s)] for i, s in enumerate(seqs)]
        res[name] = {
            "hf_vs_mcore": max((a - b).abs().max().item() for a, b in zip(ref, single, strict=True)),
            "packed_vs_hf_batch": max((a - b).abs().max().item() for a, b in zip(per, ref_batch, strict=True)),
            "logit_scale": max(a.abs().max().item() for a in ref),
            # what the scaling changes: the same model with the default RoPE gives other logits past the context
            "default_rope_gap": _default_rope_gap(args, spec, path, ps, seqs, ref),
            "rope_type": spec.rope_type,
            "attention_factor": getattr(model.config, "slime_rope_attention_factor", 1.0),
        }
        exported = dict(hf_weights.export_hf_weights(model, spec, ps))
        from safetensors.torch import load_file

        hf_tensors = load_file(os.path.join(path, "model.safetensors"))
        res[name]["roundtrip_exact"] = sorted(exported) == sorted(hf_tensors) and all(
            torch.equal(exported[k], hf_tensors[k]) for k in hf_tensors
        )
    torch.save(res, os.path.join(out_dir, "rank0.pt"))
    destroy_megatron()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("rope_scaling")
    ckpts = {}
    for name, (cls_name, max_pos, rope) in VARIANTS.items():
        _build(root / name, cls_name, max_pos, rope)
        ckpts[name] = str(root / name)
    spawn_ranks(_worker, args=(1, find_free_port(), ckpts, str(root)), nprocs=1, daemon=True)
    return torch.load(root / "rank0.pt")


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_scaled_rope_logits_equal_hf_past_the_original_context(results, variant):
    r = results[variant]
    assert r["rope_type"] == VARIANTS[variant][2]["rope_type"]
    assert r["logit_scale"] > 0.5  # not a comparison of near-zero logits
    assert r["hf_vs_mcore"] <= 1e-5, r
    assert r["packed_vs_hf_batch"] <= 1e-5, r
    assert r["roundtrip_exact"]
    assert r["default_rope_gap"] > 1e-3, r  # unscaled RoPE would not pass: the scaling is what is compared


def test_yarn_scales_cos_and_sin_by_hf_attention_factor(results):
    import math

    assert results["qwen25_yarn"]["attention_factor"] == pytest.approx(0.1 * math.log(4.0) + 1.0)
    assert results["llama31_llama3"]["attention_factor"] == 1.0
