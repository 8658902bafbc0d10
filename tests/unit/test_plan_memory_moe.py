"""The memory plan counts MoE models as they are: every expert in the model, `num_experts / ep` on a rank, and
expert optimizer state sharded over the expert-data-parallel group (slime/backends/megatron/memory.py)."""

from __future__ import annotations

import math

import pytest

from slime.backends.megatron.hf_config import read_hf_config
from slime.backends.megatron.memory import MemoryConfig, ModelShape, build_memory_plan, full_params, params_per_rank

pytestmark = pytest.mark.cpu


@pytest.fixture(scope="module", params=[("qwen3_moe", False), ("qwen2_moe", False), ("qwen3_moe", True)])
def moe(request, tmp_path_factory):
    from sim.tiny_checkpoint import build_random_moe

    model_type, tied = request.param
    out = tmp_path_factory.mktemp(model_type) / "model"
    build_random_moe(out, model_type, tie_word_embeddings=tied)
    return out


def test_full_count_equals_the_hf_models(moe):
    from transformers import AutoModelForCausalLM

    hf = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(moe).parameters())
    assert full_params(ModelShape.of(read_hf_config(moe))) == hf


def test_expert_parallelism_splits_only_the_experts(moe):
    spec = read_hf_config(moe)
    shape = ModelShape.of(spec)
    experts = spec.num_layers * spec.num_experts * 3 * spec.moe_ffn_hidden_size * spec.hidden_size
    one, two = params_per_rank(shape, 1, 1, 0, ep=1), params_per_rank(shape, 1, 1, 0, ep=2)
    assert one - two == experts // 2


def test_expert_optimizer_state_shards_over_expert_data_parallel(moe):
    """4 ranks as DP 4 with EP 2: dense state over 4 ranks, expert state over the 2 ranks holding each expert."""
    spec = read_hf_config(moe)
    shape = ModelShape.of(spec)
    experts_ep1 = spec.num_layers * spec.num_experts * 3 * spec.moe_ffn_hidden_size * spec.hidden_size
    plan = build_memory_plan(MemoryConfig(actor=shape, dp=4, ep=2, bf16=True, colocated=False, policy="none"))
    adam_m = plan.stages[0].phase("actor_train").gpu["actor/adam_m"]
    dense = full_params(shape) - experts_ep1
    assert adam_m == 4 * (math.ceil(dense / 4) + math.ceil(experts_ep1 // 2 / 2))
