"""The fake `hf` engine serves MoE checkpoints under the names checkpoints (and slime's trainer) use per expert,
although transformers holds each layer's experts as two fused tensors (sim/fake_sglang/hf_names.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from sim.fake_sglang.hf_names import checkpoint_named_tensors
from sim.fake_sglang.testing import launch_fake_sglang
from sim.tiny_checkpoint import build_random_moe, build_tiny_checkpoint
from slime.backends.megatron.weight_hash import compare_checksums, fetch_engine_checksums, tensor_checksum
from slime.backends.megatron.weight_sync import TensorWeightSync

pytestmark = pytest.mark.cpu


def _moe_checkpoint(root: Path, model_type: str) -> Path:
    """A random MoE checkpoint with the tiny tokenizer (the engine needs one to start)."""
    tok = build_tiny_checkpoint(root / "tok")
    out = root / "model"
    build_random_moe(out, model_type, vocab_size=512)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (tok / f).is_file():
            shutil.copy(tok / f, out / f)
    return out


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen2_moe"])
def moe_ckpt(request, tmp_path_factory) -> Path:
    return _moe_checkpoint(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def qwen2_moe_ckpt(tmp_path_factory) -> Path:
    """One engine start is enough for the sync: Qwen2-MoE has the shared expert on top of the routed ones."""
    return _moe_checkpoint(tmp_path_factory.mktemp("sync"), "qwen2_moe")


def _on_disk(ckpt: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def test_per_expert_views_are_the_checkpoint_tensors(moe_ckpt):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(moe_ckpt, dtype=torch.float32)
    fused = [n for n, _ in model.named_parameters() if n.endswith("experts.gate_up_proj")]
    assert fused, "transformers no longer fuses experts: hf_names.py has nothing to do"
    named = dict(checkpoint_named_tensors(list(model.named_parameters())))
    disk = _on_disk(moe_ckpt)
    assert named.keys() == disk.keys()
    assert all(torch.equal(named[n], disk[n]) for n in named), [n for n in named if not torch.equal(named[n], disk[n])]


def test_a_sync_of_per_expert_tensors_lands_in_the_fused_experts(qwen2_moe_ckpt):
    moe_ckpt = qwen2_moe_ckpt
    disk = _on_disk(moe_ckpt)
    torch.manual_seed(1)
    sent = {n: t + 0.01 * torch.randn_like(t) for n, t in disk.items()}  # every tensor changes
    with launch_fake_sglang(["--engine", "hf", "--model-path", str(moe_ckpt)]) as eng:
        before = fetch_engine_checksums(eng.url)
        assert any(".experts.3.down_proj.weight" in n for n in before)
        sync = TensorWeightSync([eng.url], bucket_bytes=1 << 16)
        try:
            sync.sync(list(sent.items()), weight_version=2)
        finally:
            sync.close()
        after = fetch_engine_checksums(eng.url)
    expected = {n: tensor_checksum(t) for n, t in sent.items()}
    assert compare_checksums(expected, {n: after[n] for n in expected}) == []
    assert all(after[n] != before[n] for n in expected)
