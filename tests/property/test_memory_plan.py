"""The memory plan (closed form, slime/backends/megatron/memory.py) against the accountant's replay of a colocated
step on every simulated rank (sim/fake_megatron/memory_accountant.py), for random shapes, layouts, roles, precision
and offload policies.

- every phase's GPU and host peak, and every stage's overall peaks, are the accountant's exactly;
- the default policy keeps (param bytes + 4) bytes of host less per trained parameter than `--legacy-offload` on
  every rank while the trainers sleep — 6 B/param in bf16 — counting every trained model (actor, and critic with
  PPO); the reference policy's copy is the same under both;
- a configuration the plan calls feasible never exceeds the GPU's capacity in the replay, and one it refuses
  does somewhere.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sim.fake_megatron.memory_accountant import replay
from slime.backends.megatron.memory import (
    GiB,
    MemoryConfig,
    ModelShape,
    build_memory_plan,
    host_saving_per_rank,
    params_per_rank,
)

pytestmark = pytest.mark.cpu


@st.composite
def shapes(draw, tp: int) -> ModelShape:
    groups = tp * draw(st.integers(1, 2))
    heads = groups * draw(st.integers(1, 3))
    d = draw(st.sampled_from([8, 16, 32]))
    return ModelShape(
        vocab_size=draw(st.integers(50, 3000)),
        num_layers=draw(st.integers(1, 3)) * draw(st.sampled_from([1, 2])),
        hidden_size=heads * d if draw(st.booleans()) else draw(st.sampled_from([64, 96, 128])),
        ffn_hidden_size=tp * draw(st.integers(8, 64)),
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=d,
        qkv_bias=draw(st.booleans()),
        qk_layernorm=draw(st.booleans()),
        tie_word_embeddings=draw(st.booleans()),
    )


@st.composite
def configs(draw) -> MemoryConfig:
    tp = draw(st.sampled_from([1, 2, 4]))
    actor = draw(shapes(tp))
    pp = draw(st.sampled_from([p for p in (1, 2, 3) if actor.num_layers % p == 0]))
    critic = None
    if draw(st.booleans()):
        critic = actor if draw(st.booleans()) else dataclasses.replace(draw(shapes(tp)), num_layers=actor.num_layers)
    tokens = draw(st.integers(1, 256))
    return MemoryConfig(
        actor=actor,
        critic=critic,
        tp=tp,
        pp=pp,
        dp=draw(st.sampled_from([1, 2, 3, 4])),
        cp=draw(st.sampled_from([1, 2])),
        reference=draw(st.booleans()),
        distributed_optimizer=draw(st.booleans()),
        bf16=draw(st.booleans()),
        policy=draw(st.sampled_from(["v0.3.0", "legacy", "none"])),
        colocated=draw(st.booleans()),
        engine_fraction=draw(st.sampled_from([0.1, 0.5, 0.85])),
        gpu_capacity=draw(st.integers(2**20, 2**28)),
        train_tokens=tokens,
        logprob_tokens=draw(st.sampled_from([tokens, 2 * tokens])),
        adam_foreach=draw(st.booleans()),
        bucket_bytes=draw(st.sampled_from([2**10, 2**16, 2**29])),
        engine_tp=draw(st.sampled_from([1, 2])),
    )


@given(configs())
def test_accountant_peaks_equal_the_plan(cfg):
    plan = build_memory_plan(cfg)
    acc = replay(cfg)
    for stage in plan.stages:
        s = stage.pp_rank
        assert {r: st_.params for r, st_ in stage.roles.items()} == acc.numel[s]
        assert {u.phase: u.gpu_total for u in stage.phases} == acc.gpu[s]
        assert {u.phase: u.host_total for u in stage.phases} == acc.host[s]
        assert stage.peak_gpu == acc.peak_gpu(s) and stage.peak_host == acc.peak_host(s)


@given(configs())
def test_default_policy_saves_param_bytes_plus_grad_per_trained_param(cfg):
    new = build_memory_plan(dataclasses.replace(cfg, policy="v0.3.0"))
    old = build_memory_plan(dataclasses.replace(cfg, policy="legacy"))
    p = 2 if cfg.bf16 else 4
    for stage in new.stages:
        trained = sum(r.params for r in stage.roles.values())  # actor + critic (PPO); never the reference
        assert host_saving_per_rank(new, old, stage.pp_rank) == (p + 4) * trained
        acc_new, acc_old = replay(new.config, every_rank=False), replay(old.config, every_rank=False)
        assert acc_old.host[stage.pp_rank]["rollout"] - acc_new.host[stage.pp_rank]["rollout"] == (p + 4) * trained
        if cfg.bf16:
            assert host_saving_per_rank(new, old, stage.pp_rank) == 6 * trained


@given(configs())
def test_feasible_plans_fit_the_gpu_in_the_replay(cfg):
    plan = build_memory_plan(cfg)
    acc = replay(cfg, every_rank=False)
    over = any(acc.peak_gpu(s) > cfg.gpu_capacity for s in acc.gpu)
    if plan.feasible:
        assert not over
    elif not any(p.startswith("engine weights") for p in plan.problems):
        assert over


def test_param_count_of_a_known_model():
    # Qwen2.5-1.5B: 1,543,714,304 parameters (tied embeddings), the number its model card gives
    qwen = ModelShape(151936, 28, 1536, 8960, 12, 2, 128, True, False, True)
    assert params_per_rank(qwen, 1, 1, 0) == 1_543_714_304
    # TP 2: every matrix and bias halves, norms are replicated; the stages of PP 2 add up (plus the last stage's output copy)
    halves = params_per_rank(qwen, 2, 1, 0)
    norms = 28 * 2 * 1536 + 1536
    assert halves == (1_543_714_304 - norms) // 2 + norms
    stages = params_per_rank(qwen, 1, 2, 0) + params_per_rank(qwen, 1, 2, 1)
    assert stages == 1_543_714_304 + 151936 * 1536
    assert params_per_rank(qwen, 1, 1, 0, critic=True) == 1_543_714_304 + 1537  # untied embedding + value head


def test_an_h200_fits_a_1_5b_colocated_ppo_step_and_a_small_gpu_does_not():
    qwen = ModelShape(151936, 28, 1536, 8960, 12, 2, 128, True, False, True)
    cfg = MemoryConfig(actor=qwen, critic=qwen, gpu_capacity=141 * GiB, train_tokens=4096, engine_fraction=0.6)
    plan = build_memory_plan(cfg)
    assert plan.feasible, plan.problems
    assert plan.stages[0].peak_gpu_phase == "rollout"  # the engine's fraction is the largest tenant
    small = build_memory_plan(dataclasses.replace(cfg, gpu_capacity=24 * GiB))
    assert not small.feasible and "actor_train" in " ".join(small.problems)
