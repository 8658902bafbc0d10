"""MoE configs, in process: HF's Qwen2-MoE / Qwen3-MoE fields map to megatron's `TransformerConfig` MoE fields,
what megatron would compute differently is refused with one line, and the expert-parallel flags are accepted
only for MoE checkpoints in the layouts the multi-process tests prove (tests/unit/test_moe_models.py,
test_moe_layouts.py), refused with one line before Ray starts otherwise."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slime.arguments import parse_args
from slime.backends.megatron import hf_config
from slime.utils.errors import SlimeArgError

pytestmark = pytest.mark.cpu

_QWEN3_MOE = dict(
    model_type="qwen3_moe",
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_experts=4,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
    router_aux_loss_coef=0.001,
)
_QWEN2_MOE = {
    **{k: v for k, v in _QWEN3_MOE.items() if k != "head_dim"},
    "model_type": "qwen2_moe",
    "norm_topk_prob": False,
    "shared_expert_intermediate_size": 48,
    "sliding_window": 0,
    "use_sliding_window": False,
}


def test_qwen3_moe_maps_to_megatron_moe_fields(make_args: Callable[..., Any]):
    from megatron.core.transformer import TransformerConfig

    spec = hf_config.read_hf_config(_QWEN3_MOE)
    assert spec.is_moe and spec.qk_layernorm and not spec.qkv_bias
    assert (spec.num_experts, spec.moe_router_topk, spec.moe_ffn_hidden_size) == (4, 2, 32)
    assert spec.shared_expert_intermediate_size is None
    kw = hf_config.transformer_config_kwargs(spec, make_args(expert_model_parallel_size=2))
    assert (kw["num_moe_experts"], kw["moe_router_topk"], kw["moe_ffn_hidden_size"]) == (4, 2, 32)
    assert kw["moe_router_pre_softmax"] is False  # norm_topk_prob: softmax over the selected k
    assert kw["moe_aux_loss_coeff"] == 0.001  # the checkpoint's router_aux_loss_coef by default
    assert kw["moe_shared_expert_intermediate_size"] is None and not kw["moe_shared_expert_gate"]
    assert kw["moe_token_dispatcher_type"] == "alltoall" and not kw["moe_grouped_gemm"]
    TransformerConfig(**kw)  # megatron accepts it


def test_qwen2_moe_has_a_gated_shared_expert_and_qkv_bias(make_args: Callable[..., Any]):
    from megatron.core.transformer import TransformerConfig

    spec = hf_config.read_hf_config(_QWEN2_MOE)
    assert spec.qkv_bias and not spec.qk_layernorm and spec.shared_expert_intermediate_size == 48
    kw = hf_config.transformer_config_kwargs(spec, make_args(moe_aux_loss_coeff=0.0))
    assert kw["moe_router_pre_softmax"] is True  # no renormalisation: softmax over all experts, then top-k
    assert kw["moe_shared_expert_intermediate_size"] == 48 and kw["moe_shared_expert_gate"]
    assert kw["moe_aux_loss_coeff"] == 0.0  # the flag wins over router_aux_loss_coef
    TransformerConfig(**kw)


def test_transformers5_expert_count_name():
    cfg = {k: v for k, v in _QWEN3_MOE.items() if k != "num_experts"}
    assert hf_config.read_hf_config({**cfg, "num_local_experts": 8}).num_experts == 8


def test_dense_configs_have_no_moe_fields(make_args: Callable[..., Any]):
    dense = {k: v for k, v in _QWEN3_MOE.items() if "exp" not in k and k != "norm_topk_prob"}
    spec = hf_config.read_hf_config({**dense, "model_type": "qwen3"})
    assert not spec.is_moe
    assert "num_moe_experts" not in hf_config.transformer_config_kwargs(spec, make_args())


def test_dense_layers_follow_hf_rule():
    # layer i is sparse unless in mlp_only_layers or (i + 1) % decoder_sparse_step != 0 (Qwen2/3-MoE's rule)
    assert hf_config.read_hf_config({**_QWEN3_MOE, "decoder_sparse_step": 2}).moe_layer_pattern == (0, 1)
    assert hf_config.read_hf_config({**_QWEN3_MOE, "mlp_only_layers": [1]}).moe_layer_pattern == (1, 0)
    assert hf_config.read_hf_config(_QWEN3_MOE).moe_layer_pattern is None  # every layer sparse


@pytest.mark.parametrize(
    "patch,needle",
    [
        ({"mlp_only_layers": list(range(_QWEN3_MOE["num_hidden_layers"]))}, "without a sparse layer"),
        ({"num_experts_per_tok": 1}, "num_experts_per_tok 1 with norm_topk_prob"),
        ({"num_experts_per_tok": 5}, "num_experts_per_tok 5"),
        ({"num_experts": 0}, "no num_experts"),
    ],
)
def test_unsupported_moe_configs_fail_with_one_line(patch, needle):
    with pytest.raises(SlimeArgError, match=needle) as e:
        hf_config.read_hf_config({**_QWEN3_MOE, **patch})
    assert "\n" not in str(e.value)


@settings(max_examples=40, deadline=None)
@given(num_experts=st.integers(1, 16), ep=st.integers(1, 8), moe_ffn=st.integers(1, 64), etp=st.integers(1, 4))
def test_expert_layout_divisibility(num_experts: int, ep: int, moe_ffn: int, etp: int):
    from slime.arguments import default_args

    spec = hf_config.read_hf_config(
        {**_QWEN3_MOE, "num_experts": num_experts, "num_experts_per_tok": 1, "norm_topk_prob": False,
         "moe_intermediate_size": moe_ffn}
    )  # fmt: skip
    args = default_args(expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    if num_experts % ep or moe_ffn % etp:
        with pytest.raises(SlimeArgError, match="must divide"):
            hf_config.moe_config_kwargs(spec, args)
    else:
        kw = hf_config.moe_config_kwargs(spec, args)
        assert kw["num_moe_experts"] == num_experts and kw["moe_ffn_hidden_size"] == moe_ffn


# ---------------------------------------------------------------- flags, before Ray


def _model(tmp_path, cfg: dict[str, Any]) -> str:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def _argv(model: str, *extra: str) -> list[str]:
    return ["--hf-checkpoint", model, "--rollout-batch-size", "4", "--num-rollout", "1", "--rollout-num-gpus", "1",
            "--actor-num-gpus-per-node", "4", *extra]  # fmt: skip


def test_expert_parallel_accepted_for_moe(tmp_path):
    args = parse_args(_argv(_model(tmp_path, _QWEN3_MOE), "--expert-model-parallel-size", "4"))
    assert args.expert_model_parallel_size == 4
    args = parse_args(_argv(str(tmp_path / "model"), "--expert-model-parallel-size", "2", "--moe-aux-loss-coeff", "0"))
    assert args.moe_aux_loss_coeff == 0.0 and args.expert_tensor_parallel_size is None
    for extra in (["--context-parallel-size", "2"], ["--pipeline-model-parallel-size", "2"]):  # with EP=2: 4 GPUs
        assert parse_args(_argv(str(tmp_path / "model"), "--expert-model-parallel-size", "2", *extra))


@pytest.mark.parametrize(
    "cfg,extra,needle",
    [
        ({"model_type": "qwen2"}, ["--expert-model-parallel-size", "2"], "needs an MoE checkpoint"),
        ({"model_type": "qwen2"}, ["--expert-tensor-parallel-size", "1"], "needs an MoE checkpoint"),
        (_QWEN3_MOE, ["--expert-model-parallel-size", "3"], "does not divide|must divide"),
        (_QWEN3_MOE, ["--expert-model-parallel-size", "8"], "must divide num_experts"),
        (_QWEN3_MOE, ["--tensor-model-parallel-size", "2"], "sequence parallelism"),
        (_QWEN3_MOE, ["--expert-tensor-parallel-size", "2"], "--expert-tensor-parallel-size > 1"),
        (
            _QWEN3_MOE,
            [
                "--pipeline-model-parallel-size",
                "2",
                "--virtual-pipeline-model-parallel-size",
                "2",
                "--no-offload-train",
            ],
            "virtual-pipeline-model-parallel-size with an MoE",
        ),
        (_QWEN3_MOE, ["--expert-model-parallel-size", "4", "--pipeline-model-parallel-size", "2"], "does not divide"),
        (_QWEN3_MOE, ["--advantage-estimator", "ppo"], "critic is not built for MoE"),
        (_QWEN3_MOE, ["--expert-model-parallel-size", "0"], "must be >= 1"),
    ],
)
def test_refused_layouts_give_one_line(tmp_path, cfg, extra, needle):
    with pytest.raises(SlimeArgError, match=needle) as e:
        parse_args(_argv(_model(tmp_path, cfg), *extra))
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------- expert weight layout, simulated ranks


class _Reader:
    def __init__(self, tensors: dict[str, Any]) -> None:
        self.tensors = tensors

    def get(self, name: str) -> Any:
        return self.tensors[name]


class _SimRanks:
    """The `ParallelState` of one simulated rank (ep_rank, etp_rank) for the expert gathers of the export: a gather
    returns the shards every rank of the group holds for the same (parameter, EP slot), as the real groups do. A
    gathered tensor is recognised by its values (random, so unique; export may copy or detach it)."""

    def __init__(self, shards: dict[tuple[str, int, int], Any], ep: int, etp: int, ep_rank: int, etp_rank: int):
        self.shards, self.sizes = shards, {"tp": 1, "ep": ep, "etp": etp}
        self.ranks = {"tp": 0, "ep": ep_rank, "etp": etp_rank}

    def size(self, dim: str) -> int:
        return self.sizes[dim]

    def rank(self, dim: str) -> int:
        return self.ranks[dim]

    def all_gather(self, t: Any, dim: str) -> list[Any]:
        import torch

        ((name, ep_r, etp_r),) = (k for k, v in self.shards.items() if v.shape == t.shape and torch.equal(v, t))
        keys = [(name, r, etp_r) if dim == "ep" else (name, ep_r, r) for r in range(self.sizes[dim])]
        return [self.shards[k].clone() for k in keys]


@settings(max_examples=25, deadline=None)
@given(
    ep=st.sampled_from([1, 2, 4]),
    etp=st.sampled_from([1, 2, 4]),
    per_rank=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_expert_shards_load_and_export_back_to_every_hf_expert(ep: int, etp: int, per_rank: int, seed: int):
    """Loading HF experts into every (EP, ETP) rank and exporting them (gather over ETP, then EP) gives back every
    expert under its own HF name, bit for bit, on every rank: the layout rules of hf_weights.py for any sizes."""
    import torch

    from slime.backends.megatron import hf_weights

    experts, hidden, ffn = ep * per_rank, 8, 4 * etp
    spec = hf_config.read_hf_config(
        {**_QWEN3_MOE, "num_experts": experts, "num_experts_per_tok": 1, "norm_topk_prob": False,
         "moe_intermediate_size": ffn, "hidden_size": hidden}
    )  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    hf = {}
    for e in range(experts):
        p = f"model.layers.0.mlp.experts.{e}."
        hf |= {p + "gate_proj.weight": torch.randn(ffn, hidden, generator=g),
               p + "up_proj.weight": torch.randn(ffn, hidden, generator=g),
               p + "down_proj.weight": torch.randn(hidden, ffn, generator=g)}  # fmt: skip
    names = [f"decoder.layers.0.mlp.experts.local_experts.{j}.{k}.weight" for j in range(per_rank)
             for k in ("linear_fc1", "linear_fc2")]  # fmt: skip
    shards = {
        (n, r, t): hf_weights._hf_shard_for(n, _Reader(hf), spec, hf_weights.ShardRanks(1, 0, ep, r, etp, t), 0)
        for n in names
        for r in range(ep)
        for t in range(etp)
    }
    assert shards[(names[0], 0, 0)].shape == (2 * ffn // etp, hidden)  # this rank's gate and up rows
    for r in range(ep):
        for t in range(etp):
            ps = _SimRanks(shards, ep, etp, r, t)
            local = [(n, shards[(n, r, t)]) for n in names]
            got = dict(hf_weights.iter_hf_tensors(local, spec, ps))
            assert set(got) == set(hf), (r, t)
            assert all(torch.equal(got[n], hf[n]) for n in hf), (r, t)
