"""slime's torch port of SGLang's GPU tensor hash equals SGLang's Triton kernel, value for value.

The expected values were produced by SGLang's own kernel (python/sglang/kernels/ops/memory/gpu_tensor_hash.py)
executed by Triton's interpreter on CPU (`tests/fixtures/sglang_gpu_tensor_hash.json` says how); on the H200 the
GPU tests compare with a real SGLang's `/weights_checker` (tests/gpu/test_real_sglang.py). The tensors are built
from integer formulas, not a random generator, so they are the same bytes on every machine and torch version.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from slime.backends.megatron import gpu_tensor_hash as gpu_tensor_hash_module
from slime.backends.megatron.gpu_tensor_hash import gpu_tensor_checksum, gpu_tensor_hash

pytestmark = pytest.mark.cpu

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "sglang_gpu_tensor_hash.json"

# name -> (shape, dtype): shapes cross the kernel's 8192-word tiles (and, with small chunks, the port's chunks), byte counts that are not a multiple of 4, and a transposed (non-contiguous) view
RECIPES = {
    "f32_3x5": ((3, 5), torch.float32),
    "bf16_7": ((7,), torch.bfloat16),
    "bf16_odd_bytes_3": ((3,), torch.bfloat16),
    "u8_13": ((13,), torch.uint8),
    "bf16_3_tiles_plus": ((8192 * 6 + 35,), torch.bfloat16),
    "f32_exact_tile": ((8192,), torch.float32),
    "f16_256x129": ((256, 129), torch.float16),
    "f32_transposed_64x48": ((48, 64), torch.float32),
    "zeros_f32_5": ((5,), torch.float32),
    "bf16_40_tiles": ((2 * 8192 * 40 + 1001,), torch.bfloat16),
}


def build(name: str) -> torch.Tensor:
    shape, dtype = RECIPES[name]
    n = torch.Size(shape).numel()
    if name.startswith("zeros"):
        return torch.zeros(shape, dtype=dtype)
    i = torch.arange(n, dtype=torch.int64)
    if dtype == torch.uint8:
        return ((i * 2654435761) % 251).to(torch.uint8).reshape(shape)
    t = (((i * 2654435761) % 65521) - 32760).to(torch.float64) / 4096  # exact in every float dtype used here
    t = t.to(dtype).reshape(shape)
    return t.t() if name.startswith("f32_transposed") else t


@pytest.mark.parametrize("chunk_tiles", [2048, 3])  # the default, and chunks that split the larger recipes
def test_the_port_equals_sglangs_kernel_on_every_recipe(monkeypatch, chunk_tiles):
    monkeypatch.setattr(gpu_tensor_hash_module, "_CHUNK_TILES", chunk_tiles)
    expected = json.loads(FIXTURE.read_text())["hashes"]
    assert set(expected) == set(RECIPES)
    for name in RECIPES:
        assert gpu_tensor_checksum(build(name)) == expected[name], name


def test_one_bit_anywhere_changes_the_hash():
    t = build("bf16_3_tiles_plus")
    base = gpu_tensor_hash(t)
    for pos in (0, 8191, 8192, t.numel() - 1):
        u = t.clone()
        u.view(torch.int16)[pos] ^= 1
        assert gpu_tensor_hash(u) != base, pos
    assert gpu_tensor_hash(torch.zeros(0)) == 0


def test_checksums_in_sglangs_fused_layout():
    """A TP-1 SGLang holds q/k/v (weight and bias) stacked as qkv_proj and gate/up as gate_up_proj; the trainer
    fuses its HF tensors the same way before hashing (parts in any order of arrival) and hashes as a GPU engine."""
    from slime.backends.megatron.weight_hash import ChecksumLayout, fused_hf_tensors, hf_weight_checksums

    g = torch.Generator().manual_seed(0)
    p = "model.layers.0."
    hf = {n: torch.randn(s, generator=g) for n, s in [
        (p + "self_attn.k_proj.weight", (2, 4)), (p + "self_attn.q_proj.weight", (4, 4)),
        (p + "self_attn.v_proj.weight", (2, 4)), (p + "self_attn.q_proj.bias", (4,)), (p + "self_attn.k_proj.bias", (2,)),
        (p + "self_attn.v_proj.bias", (2,)), (p + "mlp.up_proj.weight", (6, 4)), (p + "mlp.gate_proj.weight", (6, 4)),
        (p + "self_attn.o_proj.weight", (4, 4)), ("model.norm.weight", (4,)),
    ]}  # fmt: skip
    fused = dict(fused_hf_tensors(hf.items()))
    assert set(fused) == {p + "self_attn.qkv_proj.weight", p + "self_attn.qkv_proj.bias", p + "mlp.gate_up_proj.weight",
                          p + "self_attn.o_proj.weight", "model.norm.weight"}  # fmt: skip
    qkv = torch.cat([hf[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
    assert torch.equal(fused[p + "self_attn.qkv_proj.weight"], qkv)
    assert torch.equal(fused[p + "mlp.gate_up_proj.weight"], torch.cat([hf[p + "mlp.gate_proj.weight"],
                                                                        hf[p + "mlp.up_proj.weight"]]))  # fmt: skip
    sums = hf_weight_checksums(hf.items(), layout=ChecksumLayout(fused=True, gpu_hash=True))
    assert sums[p + "self_attn.qkv_proj.weight"] == gpu_tensor_checksum(qkv)
    with pytest.raises(ValueError, match="parts missing"):
        dict(fused_hf_tensors([(p + "self_attn.q_proj.weight", qkv)]))
