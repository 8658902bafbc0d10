"""Deployment-plan invariants over random topologies: engine and placeholder GPU ranges partition
[0, rollout_num_gpus), planned ports are distinct, one router per model (PD iff the model has PD groups)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slime.arguments import default_args
from slime.backends.sglang.deployment import build_plan, planned_ports
from slime.backends.sglang.sglang_config import ModelConfig, ServerGroupConfig, SGLangConfig
from tests.hypothesis_budget import examples

pytestmark = pytest.mark.cpu


@st.composite
def group(draw, kind: str) -> ServerGroupConfig:
    per_engine = draw(st.sampled_from([1, 2, 4, 8, 16]))
    engines = draw(st.integers(1, 3))
    if kind == "placeholder":
        return ServerGroupConfig("placeholder", draw(st.integers(1, 8)), per_engine, "/m")
    return ServerGroupConfig(kind, per_engine * engines, per_engine, "/m")


@st.composite
def topology(draw) -> SGLangConfig:
    models = []
    for i in range(draw(st.integers(1, 4))):
        pd = draw(st.booleans())
        kinds = ["prefill", "decode"] if pd else ["regular"] * draw(st.integers(1, 2))
        if draw(st.booleans()):
            kinds.insert(draw(st.integers(0, len(kinds))), "placeholder")
        groups = tuple(draw(group(k)) for k in kinds)
        models.append(ModelConfig(f"m{i}", "/m", i == 0, i == 0, 1, groups))
    return SGLangConfig(tuple(models))


@settings(max_examples=examples(300), deadline=None)
@given(cfg=topology(), actor=st.integers(1, 16), colocate=st.booleans(), offload=st.booleans())
def test_plan_invariants(cfg, actor, colocate, offload):
    n = cfg.num_gpus
    # one node of 8 GPUs, no user router: the parser's defaults
    args = default_args(actor_num_gpus_per_node=actor, colocate=colocate, offload_rollout=offload)
    plan = build_plan(args, cfg)
    assert plan.rollout_num_gpus == n
    # engines + placeholder groups tile [0, n) exactly once
    ranges = [e.gpu_range for e in plan.engines]
    ranges += [(g.gpu_start, g.gpu_start + g.num_gpus) for g in plan.groups if g.worker_type == "placeholder"]
    covered = sorted(gpu for lo, hi in ranges for gpu in range(lo, hi))
    assert covered == list(range(n))
    offset = 0 if colocate else actor
    assert all(e.base_gpu_id == offset + e.gpu_start for e in plan.engines)
    ports = planned_ports(plan)
    assert len(ports) == len(set(ports))
    assert [r.model for r in plan.routers] == [m.name for m in cfg.models]
    assert [r.pd for r in plan.routers] == [m.is_pd for m in cfg.models]
    assert all((e.bootstrap_port is not None) == (e.worker_type == "prefill") for e in plan.engines)
    assert sum(r.receives_weights for r in plan.routers) == 1
    starts = {(g.model, g.group): g.gpu_start for g in plan.groups}
    for e in plan.engines:
        # offloaded iff offload_rollout and the group's first GPU lies in the Megatron range [0, actor)
        assert e.needs_offload == (offload and offset + starts[(e.model, e.group)] < actor)
        assert e.enable_memory_saver == e.needs_offload
