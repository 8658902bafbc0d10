"""HF checkpoint ↔ megatron-core GPTModel weights, with tensor-parallel sharding (Qwen2/Qwen3/Llama family).

Why by hand (no Megatron-Bridge): the family is small and the layout rules are few, and weight sync must
produce HF-named full tensors that SGLang's loader accepts. The rules, for megatron-core 0.16.1's local spec:

- `linear_qkv` fuses q/k/v *per query group*: for each of the `ng` KV heads, its np/ng query heads, then its
  key head, then its value head (`SelfAttention.get_query_key_value_tensors`). The fused tensor is
  column-parallel: rank r holds row chunk r of the full fused tensor (when ng < tp, megatron all-gathers
  and re-slices itself, so the plain chunking stays right).
- `linear_fc1` fuses gate and up; megatron's GLU splits *each rank's* output in halves, so rank r holds
  `cat(gate.chunk(tp)[r], up.chunk(tp)[r])`.
- `linear_proj` / `linear_fc2` are row-parallel (split along the input dim); embedding and output layer are
  vocab-parallel over the vocabulary padded to a multiple of tp (padded rows are zero, and cropped on export).
- Norms are replicated: `input_layernorm`, `pre_mlp_layernorm` (the local spec's separate norm modules),
  `q_layernorm` / `k_layernorm` (Qwen3), `decoder.final_layernorm`.
- Pipeline stages hold local layer indices; HF names use global ones (`get_transformer_layer_offset`).
- MoE layers (Qwen2-MoE / Qwen3-MoE, `SequentialMLP` experts): `mlp.router.weight` is HF's `mlp.gate.weight`
  (replicated). Expert parallelism: EP rank e holds experts `e * n_local … (e + 1) * n_local - 1` as
  `mlp.experts.local_experts.{j}`; each expert's `linear_fc1` / `linear_fc2` follow the dense fc1 / fc2 rules
  over the *expert* tensor-parallel group (ETP, defaults to TP). The shared expert
  (`mlp.shared_experts.linear_fc1/fc2`, Qwen2-MoE's `mlp.shared_expert.*`) is TP-sharded like a dense MLP; its
  gate `mlp.shared_experts.gate_weight` is HF's `mlp.shared_expert_gate.weight` (replicated). Export gathers
  over ETP, then over EP, and yields every expert under its HF name `mlp.experts.{global}.{gate,up,down}_proj`.

Use: `load_hf_weights(model, hf_dir, spec, ps)` right after `build_gpt_model` and before the optimizer is
built (its fp32 copies are taken from the params). For weight sync,
`for bucket in export_hf_weights(model, spec, ps, bucket_bytes): ...` yields lists of `(hf_name, tensor)`
with HF shapes; it is a collective over the TP group, and for MoE over the EP and ETP groups (every rank of
them must iterate it). Each PP stage yields
only its own layers (embedding on the first stage, final norm and untied `lm_head` on the last).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import safe_open

from slime.backends.megatron.hf_config import HFModelSpec, padded_vocab_size
from slime.parallel_state import ParallelState

logger = logging.getLogger(__name__)

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")

# mcore suffix inside a layer -> HF suffix inside `model.layers.{i}.` (one-to-one tensors).
_LAYER_DIRECT = {
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
_ROW_PARALLEL = {"self_attention.linear_proj.weight", "mlp.linear_fc2.weight"}
_GLOBAL_DIRECT = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}
_VOCAB_PARALLEL = {"embedding.word_embeddings.weight", "output_layer.weight"}
# MoE layers: replicated one-to-one tensors, the shared expert (TP-sharded), the routed experts (EP x ETP)
_MOE_REPLICATED = {
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.shared_experts.gate_weight": "mlp.shared_expert_gate.weight",
    "mlp.router.expert_bias": "mlp.gate.e_score_correction_bias",  # GLM-4.5's routing bias (a buffer)
}
_ROUTER_BIAS = "router.expert_bias"


def _shared(spec: HFModelSpec) -> str:
    """HF's prefix of the shared expert: Qwen2-MoE has one (`shared_expert`), GLM-4.5 `shared_experts`."""
    return "mlp.shared_experts." if spec.model_type == "glm4_moe" else "mlp.shared_expert."


def _weights_and_router_bias(model: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """The parameters, then the routers' expert-bias buffers: part of the checkpoint, though not trained."""
    yield from model.named_parameters()
    yield from ((n, b) for n, b in model.named_buffers() if n.endswith(_ROUTER_BIAS) and b is not None)


_SHARED_FC2 = "mlp.shared_experts.linear_fc2.weight"
_SHARED_FC1 = "mlp.shared_experts.linear_fc1.weight"
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")


@dataclass(frozen=True)
class ShardRanks:
    """Where this rank sits for the weight layout: TP for dense and shared-expert tensors, EP x ETP for experts."""

    tp_size: int = 1
    tp_rank: int = 0
    ep_size: int = 1
    ep_rank: int = 0
    etp_size: int = 1
    etp_rank: int = 0

    @classmethod
    def of(cls, ps: ParallelState) -> ShardRanks:
        return cls(ps.size("tp"), ps.rank("tp"), ps.size("ep"), ps.rank("ep"), ps.size("etp"), ps.rank("etp"))

    def global_expert(self, local: int, spec: HFModelSpec) -> int:
        return self.ep_rank * (int(spec.num_experts or 0) // self.ep_size) + local


# ---------------------------------------------------------------- pure layout helpers (full tensors)


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_query_groups: int) -> torch.Tensor:
    """HF q/k/v projections (weights [out, h] or biases [out]) → megatron's per-group interleaved `linear_qkv`."""
    ng = num_query_groups
    tail = q.shape[1:]
    q, k, v = (x.reshape(ng, -1, *tail) for x in (q, k, v))
    return torch.cat([q, k, v], dim=1).reshape(-1, *tail)


def qkv_views(
    qkv: torch.Tensor, num_query_groups: int, num_attention_heads: int, kv_channels: int
) -> list[tuple[torch.Tensor, torch.Size]]:
    """q, k and v of a fused `linear_qkv` as strided views ([groups, rows per group, ...]) with the HF shape each
    has once flattened: the group interleaving makes the HF tensors non-views, so a copy happens only where the
    values land (a weight-sync bucket, `weight_buckets.flatten`) instead of in a temporary."""
    ng, hn = num_query_groups, kv_channels
    q_per_group = num_attention_heads // ng * hn
    tail = qkv.shape[1:]
    grouped = qkv.reshape(ng, q_per_group + 2 * hn, *tail)
    bounds = (0, q_per_group, q_per_group + hn, q_per_group + 2 * hn)
    return [(grouped[:, a:b], torch.Size((ng * (b - a), *tail))) for a, b in itertools.pairwise(bounds)]


def split_qkv(
    qkv: torch.Tensor, num_query_groups: int, num_attention_heads: int, kv_channels: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `fuse_qkv`."""
    q, k, v = (t.reshape(shape) for t, shape in qkv_views(qkv, num_query_groups, num_attention_heads, kv_channels))
    return q, k, v


def shard_fc1(gate: torch.Tensor, up: torch.Tensor, tp_size: int, tp_rank: int) -> torch.Tensor:
    """This rank's `linear_fc1` rows: its gate chunk followed by its up chunk."""
    return torch.cat([gate.chunk(tp_size, dim=0)[tp_rank], up.chunk(tp_size, dim=0)[tp_rank]], dim=0)


def unshard_fc1(shards: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-rank `linear_fc1` shards (TP order) → full HF (gate, up)."""
    halves = [s.chunk(2, dim=0) for s in shards]
    return _cat([g for g, _ in halves], dim=0), _cat([u for _, u in halves], dim=0)


def pad_vocab(weight: torch.Tensor, padded: int) -> torch.Tensor:
    if weight.size(0) == padded:
        return weight
    return torch.cat([weight, weight.new_zeros(padded - weight.size(0), *weight.shape[1:])], dim=0)


# ---------------------------------------------------------------- model helpers


def unwrap_model(model: Any) -> Any:
    """Strip DDP / Float16Module wrappers (`.module` chains) down to the GPTModel."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def layer_offset(model: Any) -> int:
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    model = unwrap_model(model)
    return int(get_transformer_layer_offset(model.config, vp_stage=getattr(model, "vp_stage", None)))


class HFReader:
    """Lazy tensor access over `model.safetensors` or a sharded `model.safetensors.index.json` checkpoint."""

    def __init__(self, hf_dir: str | os.PathLike) -> None:
        hf_dir = os.fspath(hf_dir)
        index = os.path.join(hf_dir, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            self._file_of = {name: os.path.join(hf_dir, fn) for name, fn in weight_map.items()}
        else:
            single = os.path.join(hf_dir, "model.safetensors")
            if not os.path.isfile(single):
                raise FileNotFoundError(f"no model.safetensors(.index.json) in {hf_dir}")
            with safe_open(single, "pt") as f:
                self._file_of = dict.fromkeys(f.keys(), single)
        self._handles: dict[str, Any] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def get(self, name: str) -> torch.Tensor:
        if name not in self._file_of:
            raise KeyError(f"HF checkpoint has no tensor {name!r}")
        path = self._file_of[name]
        if path not in self._handles:
            self._handles[path] = safe_open(path, "pt")
        return self._handles[path].get_tensor(name)


# ---------------------------------------------------------------- HF -> mcore


def _hf_shard_for(name: str, reader: HFReader, spec: HFModelSpec, ranks: ShardRanks, offset: int) -> torch.Tensor:
    """The HF-derived tensor for mcore parameter `name` (local layer index), as this rank's shard."""
    tp_size, tp_rank = ranks.tp_size, ranks.tp_rank
    m = _LAYER.match(name)
    if m is None:
        if name == "output_layer.weight" and spec.tie_word_embeddings:
            hf = reader.get("model.embed_tokens.weight")  # a tied last PP stage keeps its own copy
        else:
            hf = reader.get(_GLOBAL_DIRECT[name])
        if name in _VOCAB_PARALLEL:
            hf = pad_vocab(hf, padded_vocab_size(spec.vocab_size, tp_size))
            return hf.chunk(tp_size, dim=0)[tp_rank]
        return hf
    prefix = f"model.layers.{int(m.group(1)) + offset}."
    suffix = m.group(2)
    if suffix in _LAYER_DIRECT:
        hf = reader.get(prefix + _LAYER_DIRECT[suffix])
        return hf.chunk(tp_size, dim=1)[tp_rank] if suffix in _ROW_PARALLEL else hf
    if suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = suffix.rsplit(".", 1)[1]
        q, k, v = (reader.get(f"{prefix}self_attn.{p}_proj.{kind}") for p in "qkv")
        return fuse_qkv(q, k, v, spec.num_query_groups).chunk(tp_size, dim=0)[tp_rank]
    if suffix == "mlp.linear_fc1.weight":
        gate, up = reader.get(prefix + "mlp.gate_proj.weight"), reader.get(prefix + "mlp.up_proj.weight")
        return shard_fc1(gate, up, tp_size, tp_rank)
    if suffix in _MOE_REPLICATED:
        return reader.get(prefix + _MOE_REPLICATED[suffix])
    if suffix == _SHARED_FC1:
        gate = reader.get(prefix + _shared(spec) + "gate_proj.weight")
        return shard_fc1(gate, reader.get(prefix + _shared(spec) + "up_proj.weight"), tp_size, tp_rank)
    if suffix == _SHARED_FC2:
        return reader.get(prefix + _shared(spec) + "down_proj.weight").chunk(tp_size, dim=1)[tp_rank]
    e = _EXPERT.match(suffix)
    if e is not None:
        expert = f"{prefix}mlp.experts.{ranks.global_expert(int(e.group(1)), spec)}."
        if e.group(2) == "linear_fc1":
            gate, up = reader.get(expert + "gate_proj.weight"), reader.get(expert + "up_proj.weight")
            return shard_fc1(gate, up, ranks.etp_size, ranks.etp_rank)
        return reader.get(expert + "down_proj.weight").chunk(ranks.etp_size, dim=1)[ranks.etp_rank]
    raise KeyError(f"no HF mapping for megatron parameter {name!r}")


@torch.no_grad()
def load_hf_weights(
    models: Any | list[Any],
    hf_dir: str | os.PathLike,
    spec: HFModelSpec,
    ps: ParallelState,
    *,
    skip_prefixes: tuple[str, ...] = (),
) -> None:
    """Copy the HF checkpoint into every parameter of this rank's model chunk(s); fail if any is unmatched.

    Parameters under `skip_prefixes` are left alone (the critic's value head, which the caller fills)."""
    reader = HFReader(hf_dir)
    ranks = ShardRanks.of(ps)
    for model in models if isinstance(models, list) else [models]:
        model = unwrap_model(model)
        offset = layer_offset(model)
        for name, param in _weights_and_router_bias(model):
            if name.startswith(skip_prefixes):
                continue
            shard = _hf_shard_for(name, reader, spec, ranks, offset)
            if tuple(shard.shape) != tuple(param.shape):
                raise ValueError(f"{name}: HF gives shape {tuple(shard.shape)}, model has {tuple(param.shape)}")
            param.copy_(shard.to(param.dtype))
    logger.info("loaded HF weights from %s (%s)", hf_dir, ranks)


# ---------------------------------------------------------------- mcore -> HF


def _cat(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """`torch.cat`, but one part is returned as it is: without TP the export yields views of the live
    parameters, and the weight sync copies each once, straight into its bucket (weight_buckets.flatten)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def _gather_tp(t: torch.Tensor, ps: ParallelState, dim: str = "tp") -> list[torch.Tensor]:
    if ps.size(dim) == 1:
        return [t]
    return ps.all_gather(t.contiguous(), dim)


def _expert_tensors(
    prefix: str, local: int, kind: str, shard: torch.Tensor, spec: HFModelSpec, ps: ParallelState
) -> Iterator[tuple[str, torch.Tensor]]:
    """Local expert `local`'s fc1 / fc2 shard → the full HF tensors of that slot on every EP rank (ETP, EP gathers)."""
    per_ep = _gather_tp(shard, ps, "ep")  # EP rank r's local expert `local` is global expert r * n_local + local
    n_local = int(spec.num_experts or 0) // ps.size("ep")
    for r, s in enumerate(per_ep):
        expert = f"{prefix}mlp.experts.{r * n_local + local}."
        if kind == "linear_fc1":
            gate, up = unshard_fc1(_gather_tp(s, ps, "etp"))
            yield expert + "gate_proj.weight", gate
            yield expert + "up_proj.weight", up
        else:
            yield expert + "down_proj.weight", _cat(_gather_tp(s, ps, "etp"), dim=1)


def iter_hf_tensors(
    named_tensors: Iterable[tuple[str, torch.Tensor]], spec: HFModelSpec, ps: ParallelState, offset: int = 0
) -> Iterator[tuple[str, torch.Tensor]]:
    """(mcore local name, local shard) → (HF name, full tensor), gathering TP shards (and EP x ETP shards of
    MoE experts). A collective over those groups.

    `named_tensors` may come from a live model (`model.named_parameters()`) or from a host-side backup
    with the same names; every TP rank must pass the same names in the same order.
    """
    for name, src, shape in iter_hf_sources(named_tensors, spec, ps, offset):
        yield name, src if src.shape == shape else src.reshape(shape)


def iter_hf_sources(
    named_tensors: Iterable[tuple[str, torch.Tensor]], spec: HFModelSpec, ps: ParallelState, offset: int = 0
) -> Iterator[tuple[str, torch.Tensor, torch.Size]]:
    """`iter_hf_tensors` before its last reshape: (HF name, values, HF shape), where the values are in the HF
    tensor's row-major order but may be a strided view of another shape (q/k/v of a fused `linear_qkv`).
    Without TP/EP gathers every one is a view of the live parameter, which a weight sync can keep."""
    for name, shard in named_tensors:
        while name.startswith("module."):  # DDP / Float16Module wrappers
            name = name.removeprefix("module.")
        shard = shard.detach()
        m = _LAYER.match(name)
        if m is None:
            if name == "output_layer.weight" and spec.tie_word_embeddings:
                continue  # a tied last stage's copy of the embedding; HF has no separate lm_head
            full = _cat(_gather_tp(shard, ps), dim=0)[: spec.vocab_size] if name in _VOCAB_PARALLEL else shard
            yield _GLOBAL_DIRECT[name], full, full.shape
            continue
        prefix = f"model.layers.{int(m.group(1)) + offset}."
        suffix = m.group(2)
        if suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
            kind = suffix.rsplit(".", 1)[1]
            qkv = _cat(_gather_tp(shard, ps), dim=0)
            views = qkv_views(qkv, spec.num_query_groups, spec.num_attention_heads, spec.kv_channels)
            for p, (t, shape) in zip("qkv", views, strict=True):
                yield f"{prefix}self_attn.{p}_proj.{kind}", t, shape
            continue
        for hf_name, t in _layer_tensors(prefix, suffix, name, shard, spec, ps):
            yield hf_name, t, t.shape


def _layer_tensors(
    prefix: str, suffix: str, name: str, shard: torch.Tensor, spec: HFModelSpec, ps: ParallelState
) -> Iterator[tuple[str, torch.Tensor]]:
    """The HF tensors of one decoder-layer parameter other than the fused QKV."""
    if suffix in _LAYER_DIRECT:
        full = _cat(_gather_tp(shard, ps), dim=1) if suffix in _ROW_PARALLEL else shard
        yield prefix + _LAYER_DIRECT[suffix], full
    elif suffix == "mlp.linear_fc1.weight":
        gate, up = unshard_fc1(_gather_tp(shard, ps))
        yield prefix + "mlp.gate_proj.weight", gate
        yield prefix + "mlp.up_proj.weight", up
    elif suffix in _MOE_REPLICATED:
        yield prefix + _MOE_REPLICATED[suffix], shard
    elif suffix == _SHARED_FC1:
        gate, up = unshard_fc1(_gather_tp(shard, ps))
        yield prefix + _shared(spec) + "gate_proj.weight", gate
        yield prefix + _shared(spec) + "up_proj.weight", up
    elif suffix == _SHARED_FC2:
        yield prefix + _shared(spec) + "down_proj.weight", _cat(_gather_tp(shard, ps), dim=1)
    elif (e := _EXPERT.match(suffix)) is not None:
        yield from _expert_tensors(prefix, int(e.group(1)), e.group(2), shard, spec, ps)
    else:
        raise KeyError(f"no HF mapping for megatron parameter {name!r}")


def export_hf_weights(
    models: Any | list[Any], spec: HFModelSpec, ps: ParallelState, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """`(hf_name, full tensor)` of every parameter, one at a time (transfers bucket them: `weight_buckets.py`).

    `dtype` casts on the way out (e.g. bf16 for the rollout engine). A collective over the TP group.
    Without TP gathering or a cast, a yielded tensor may be a view of the live parameter: copy it (e.g. into a
    flattened bucket) before the next optimizer step if it must outlive the call.
    """
    for model in models if isinstance(models, list) else [models]:
        model = unwrap_model(model)
        for hf_name, tensor in iter_hf_tensors(_weights_and_router_bias(model), spec, ps, layer_offset(model)):
            yield hf_name, tensor.to(dtype) if dtype is not None else tensor
