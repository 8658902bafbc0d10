"""A HF `config.json` (Qwen2 / Qwen3 / Llama / Mistral, Qwen2-MoE / Qwen3-MoE / GLM-4.5) → a megatron-core GPTModel's shape.

Why: the model's shape comes only from `--hf-checkpoint` (there are no `--num-layers` style flags), so one
place turns HF's names into megatron's: `num_key_value_heads` → `num_query_groups`, `rms_norm_eps` →
`layernorm_epsilon`, `rope_theta` → `rotary_base`, `tie_word_embeddings` → `share_embeddings_and_output_weights`.
RoPE scaling (`linear`, `dynamic`, `yarn`, `llama3`) is computed with HF's own initialisers
(`rope_scaling.py`). Anything this family mapping cannot express exactly (other rope types, sliding windows, MLP
biases, other activations) is refused with a one-line error instead of silently giving different numbers.

MoE (`qwen2_moe`, `qwen3_moe`; `glm4_moe` in `_glm4_moe_fields`): `num_experts` → `num_moe_experts`, `num_experts_per_tok` → `moe_router_topk`,
`moe_intermediate_size` → `moe_ffn_hidden_size`, `shared_expert_intermediate_size` →
`moe_shared_expert_intermediate_size` (Qwen2-MoE's shared expert, always with its sigmoid gate), and
`norm_topk_prob` → `moe_router_pre_softmax = not norm_topk_prob`: HF takes a softmax over all experts, then the
top k, then renormalises them when `norm_topk_prob`; megatron's softmax after the top-k selection is that same
renormalisation. `router_aux_loss_coef` is the default of `--moe-aux-loss-coeff`. Dense layers between the
sparse ones (`mlp_only_layers`, `decoder_sparse_step`, HF's rule) become megatron's `moe_layer_freq` pattern:
those layers get the plain MLP of `intermediate_size`.

Vocabulary padding: `VocabParallelEmbedding` needs the vocabulary divisible by TP, so the megatron model's
vocabulary is `padded_vocab_size(vocab, tp)` (rounded up to a multiple of tp; unchanged when it divides).
Padded rows are zero; logits beyond `HFModelSpec.vocab_size` are not real tokens and callers must drop or
mask them (`packing.unpack_logits` crops them).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any

from slime.utils.errors import SlimeArgError

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama", "mistral", "qwen2_moe", "qwen3_moe", "glm4_moe")
MOE_MODEL_TYPES = ("qwen2_moe", "qwen3_moe", "glm4_moe")
SCALED_ROPE_TYPES = ("linear", "dynamic", "yarn", "llama3")  # computed with HF's own functions (rope_scaling.py)
# the config.json fields HF's rope initialisers read
ROPE_FIELDS = (
    "model_type", "hidden_size", "num_attention_heads", "head_dim", "max_position_embeddings", "rope_theta",
    "rope_parameters", "rope_scaling", "partial_rotary_factor",
)  # fmt: skip


@dataclass(frozen=True)
class HFModelSpec:
    """Everything about the HF architecture that the megatron model and the weight mapping need."""

    model_type: str
    vocab_size: int
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    qkv_bias: bool
    qk_layernorm: bool
    tie_word_embeddings: bool
    # MoE (None / 0 for dense models)
    num_experts: int | None = None
    moe_router_topk: int = 0
    moe_ffn_hidden_size: int | None = None
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int | None = None  # Qwen2-MoE: one shared expert with a sigmoid gate
    router_aux_loss_coef: float = 0.0
    moe_layer_pattern: tuple[int, ...] | None = None  # 1 = MoE, 0 = dense MLP, per layer; None: every layer MoE
    router_score_function: str = "softmax"  # GLM-4.5: "sigmoid", with a routing-only bias and a scaling factor
    router_expert_bias: bool = False
    router_scaling_factor: float | None = None
    shared_expert_gate: bool = True  # Qwen2-MoE's sigmoid gate; GLM-4.5's shared experts have none
    rotary_percent: float = 1.0  # partial rotary: RoPE on the first rotary_percent of each head
    rope_type: str = "default"  # or one of SCALED_ROPE_TYPES
    rope_fields: str = ""  # `rope_fields(cfg)`: what rope_scaling.py hands to HF's rope initialisers

    @property
    def is_moe(self) -> bool:
        return bool(self.num_experts)


def _load(config: str | os.PathLike | dict[str, Any]) -> dict[str, Any]:
    if isinstance(config, dict):
        return config
    path = os.fspath(config)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise SlimeArgError(f"--hf-checkpoint: no config.json at {path}")
    with open(path) as f:
        return json.load(f)


def _rope(cfg: dict[str, Any]) -> tuple[float, str]:
    """(rope_theta, rope type); RoPE scalings other than those `rope_scaling.py` computes as HF does are refused."""
    # transformers 5 nests rope settings in `rope_parameters`; 4.x kept `rope_theta` / `rope_scaling` flat.
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type not in ("default", *SCALED_ROPE_TYPES):
        raise SlimeArgError(
            f"--hf-checkpoint: rope type {rope_type!r} is not supported (default, {', '.join(SCALED_ROPE_TYPES)})"
        )
    return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0))), rope_type


def rope_fields(cfg: dict[str, Any]) -> str:
    """The part of a config.json that defines its RoPE, as canonical JSON (the spec stays hashable)."""
    return json.dumps({k: cfg[k] for k in ROPE_FIELDS if k in cfg}, sort_keys=True)


def read_hf_config(config: str | os.PathLike | dict[str, Any]) -> HFModelSpec:
    """Parse a checkpoint dir, a config.json path or its dict; raise `SlimeArgError` for what we cannot build."""
    cfg = _load(config)
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise SlimeArgError(
            f"--hf-checkpoint: model_type {model_type!r} is not supported by the megatron backend "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    if cfg.get("hidden_act", "silu") != "silu":
        raise SlimeArgError(f"--hf-checkpoint: hidden_act {cfg['hidden_act']!r} is not supported (only silu)")
    if cfg.get("mlp_bias"):
        raise SlimeArgError("--hf-checkpoint: mlp_bias=true is not supported")
    if cfg.get("use_sliding_window") or (model_type == "mistral" and cfg.get("sliding_window")):
        raise SlimeArgError("--hf-checkpoint: sliding-window attention is not supported")
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    moe = (
        (_glm4_moe_fields(cfg) if model_type == "glm4_moe" else _moe_fields(cfg))
        if model_type in MOE_MODEL_TYPES
        else {}
    )
    # partial rotary (GLM-4.5: 0.5, the default its config class assigns when the file has none)
    rotary = cfg.get("partial_rotary_factor") or (cfg.get("rope_parameters") or {}).get("partial_rotary_factor")
    rotary = float(rotary or (0.5 if model_type == "glm4_moe" else 1.0))
    rope_theta, rope_type = _rope(cfg)
    return HFModelSpec(
        model_type=model_type,
        vocab_size=int(cfg["vocab_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        hidden_size=hidden,
        ffn_hidden_size=int(cfg["intermediate_size"]),
        num_attention_heads=heads,
        num_query_groups=int(cfg.get("num_key_value_heads") or heads),
        kv_channels=int(cfg.get("head_dim") or hidden // heads),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_type=rope_type,
        rope_fields=rope_fields(cfg) if rope_type != "default" else "",
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        # Qwen2 always has q/k/v biases (its config has no switch); the others follow `attention_bias`.
        qkv_bias=bool(cfg.get("qkv_bias", True))
        if model_type in ("qwen2", "qwen2_moe")
        else bool(cfg.get("attention_bias", False)),
        qk_layernorm=model_type in ("qwen3", "qwen3_moe")
        or (model_type == "glm4_moe" and bool(cfg.get("use_qk_norm"))),
        rotary_percent=rotary,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        **moe,
    )


def _moe_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """The MoE part of a Qwen2-MoE / Qwen3-MoE config; refuses what megatron's MoE layer would compute differently."""
    # transformers 5 writes Qwen3-MoE's count as `num_local_experts`; the released checkpoints say `num_experts`
    num_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    if num_experts <= 0:
        raise SlimeArgError(f"--hf-checkpoint: {cfg['model_type']} config has no num_experts")
    # HF's rule (Qwen2MoeDecoderLayer / Qwen3MoeDecoderLayer): layer i is sparse unless it is in
    # mlp_only_layers or (i + 1) is not a multiple of decoder_sparse_step; a dense layer has the plain MLP
    step, dense = int(cfg.get("decoder_sparse_step", 1)), set(cfg.get("mlp_only_layers") or ())
    pattern = tuple(int(i not in dense and (i + 1) % step == 0) for i in range(int(cfg["num_hidden_layers"])))
    if not any(pattern):
        raise SlimeArgError("--hf-checkpoint: an MoE config without a sparse layer (mlp_only_layers covers them all)")
    topk = int(cfg["num_experts_per_tok"])
    norm_topk = bool(cfg.get("norm_topk_prob", False))
    if not 1 <= topk <= num_experts:
        raise SlimeArgError(f"--hf-checkpoint: num_experts_per_tok {topk} must be in [1, num_experts={num_experts}]")
    if topk == 1 and norm_topk:
        # HF renormalises a single expert's weight to 1; megatron's top-1 softmax router keeps the softmax score
        raise SlimeArgError("--hf-checkpoint: num_experts_per_tok 1 with norm_topk_prob is not supported")
    shared = int(cfg.get("shared_expert_intermediate_size") or 0) if cfg["model_type"] == "qwen2_moe" else 0
    return dict(
        num_experts=num_experts,
        moe_router_topk=topk,
        moe_ffn_hidden_size=int(cfg["moe_intermediate_size"]),
        norm_topk_prob=norm_topk,
        shared_expert_intermediate_size=shared or None,
        router_aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.0)),
        moe_layer_pattern=pattern if not all(pattern) else None,
    )


def _glm4_moe_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """GLM-4.5/4.6 (`glm4_moe`, HF's Glm4MoeTopkRouter / Glm4MoeMoE): the first `first_k_dense_replace` layers
    dense, then sigmoid-scored routed experts chosen by score + `e_score_correction_bias` (the bias only routes;
    the weights are the plain scores, renormalised, times `routed_scaling_factor`), plus `n_shared_experts`
    ungated shared experts. Megatron's sigmoid router computes exactly this with `moe_router_enable_expert_bias`;
    what it computes differently is refused."""
    num_experts, topk = int(cfg.get("n_routed_experts") or 0), int(cfg["num_experts_per_tok"])
    if num_experts <= 0:
        raise SlimeArgError("--hf-checkpoint: glm4_moe config has no n_routed_experts")
    if not 1 <= topk <= num_experts:
        raise SlimeArgError(f"--hf-checkpoint: num_experts_per_tok {topk} must be in [1, num_experts={num_experts}]")
    if int(cfg.get("n_group", 1)) != 1:
        # HF scores a group by its top 2 experts; megatron's group_limited_topk by its top (topk // topk_group)
        raise SlimeArgError("--hf-checkpoint: glm4_moe with n_group > 1 (group-limited routing) is not supported")
    if bool(cfg.get("norm_topk_prob", True)) != (topk > 1):
        # megatron's sigmoid router renormalises the top-k weights exactly when topk > 1
        raise SlimeArgError("--hf-checkpoint: glm4_moe needs norm_topk_prob true with topk > 1 (false with topk 1)")
    first_dense = int(cfg.get("first_k_dense_replace", 1))
    layers = int(cfg["num_hidden_layers"])
    if first_dense >= layers:
        raise SlimeArgError("--hf-checkpoint: an MoE config without a sparse layer (first_k_dense_replace)")
    pattern = tuple(int(i >= first_dense) for i in range(layers))
    moe_ffn = int(cfg["moe_intermediate_size"])
    shared = int(cfg.get("n_shared_experts") or 0) * moe_ffn
    scaling = float(cfg.get("routed_scaling_factor", 1.0))
    return dict(
        num_experts=num_experts,
        moe_router_topk=topk,
        moe_ffn_hidden_size=moe_ffn,
        norm_topk_prob=topk > 1,
        shared_expert_intermediate_size=shared or None,
        router_aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.0)),
        moe_layer_pattern=pattern if not all(pattern) else None,
        router_score_function="sigmoid",
        router_expert_bias=True,
        router_scaling_factor=scaling if scaling != 1.0 else None,
        shared_expert_gate=False,
    )


def padded_vocab_size(vocab_size: int, tp_size: int) -> int:
    """The megatron vocabulary: `vocab_size` rounded up to a multiple of the TP size."""
    return -(-vocab_size // tp_size) * tp_size


def check_layout_fits(spec: HFModelSpec, args: Any) -> None:
    """TP divides the heads, EP the experts, expert TP the expert FFN (torch-free: the driver's preflight runs it)."""
    tp = args.tensor_model_parallel_size
    if spec.num_attention_heads % tp or spec.num_query_groups % tp and tp % spec.num_query_groups:
        raise SlimeArgError(
            f"--tensor-model-parallel-size {tp} must divide num_attention_heads ({spec.num_attention_heads}) "
            f"and divide or be a multiple of num_key_value_heads ({spec.num_query_groups})"
        )
    moe_config_kwargs(spec, args)


def transformer_config_kwargs(spec: HFModelSpec, args: Any) -> dict[str, Any]:
    """Keyword arguments for `megatron.core.transformer.TransformerConfig` (shape, parallelism, dtype)."""
    import torch  # here, not at module level: argument validation reads configs without loading torch

    tp = args.tensor_model_parallel_size
    check_layout_fits(spec, args)
    bf16 = bool(args.bf16)
    etp = args.expert_tensor_parallel_size
    return dict(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        kv_channels=spec.kv_channels,
        layernorm_epsilon=spec.norm_eps,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias,
        qk_layernorm=spec.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # Fusions need TE/Apex or CUDA kernels; the local spec's unfused paths are exact. (model_provider turns
        # gradient_accumulation_fusion on where CUDA offers an fp32-output GEMM: wgrad_fusion.py.)
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        attention_softmax_in_fp32=True,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        microbatch_group_size_per_vp_stage=args.microbatch_group_size_per_vp_stage,
        context_parallel_size=args.context_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=etp,
        sequence_parallel=bool(args.sequence_parallel) and tp > 1,
        variable_seq_lengths=True,
        # --calculate-per-token-loss: megatron divides the step's gradient by its total token count (over
        # micro-batches and DP) and sums, not averages, over DP; else each micro-batch would be a mean of its own
        calculate_per_token_loss=bool(args.calculate_per_token_loss),
        moe_token_dispatcher_type="alltoall",  # allgather rejects variable_seq_lengths (as slime forces)
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        pipeline_dtype=torch.bfloat16 if bf16 else torch.float32,
        # CPU init makes the initial weights independent of the TP layout (and needs no CUDA).
        use_cpu_initialization=not torch.cuda.is_available(),
        recompute_granularity=args.recompute_granularity,
        recompute_method="uniform" if args.recompute_granularity == "full" else None,
        recompute_num_layers=1 if args.recompute_granularity == "full" else None,
        **moe_config_kwargs(spec, args),
    )


def moe_aux_loss_coeff(spec: HFModelSpec, args: Any) -> float:
    """`--moe-aux-loss-coeff`, or the checkpoint's `router_aux_loss_coef` when the flag is not given."""
    coeff = args.moe_aux_loss_coeff
    return float(spec.router_aux_loss_coef if coeff is None else coeff)


def moe_config_kwargs(spec: HFModelSpec, args: Any) -> dict[str, Any]:
    """The `TransformerConfig` MoE fields ({} for a dense model): HF's router, experts and shared expert."""
    if not spec.is_moe:
        return {}
    if spec.num_experts % args.expert_model_parallel_size:
        raise SlimeArgError(
            f"--expert-model-parallel-size {args.expert_model_parallel_size} must divide num_experts "
            f"({spec.num_experts})"
        )
    etp = args.expert_tensor_parallel_size or args.tensor_model_parallel_size
    if spec.moe_ffn_hidden_size % etp:
        raise SlimeArgError(
            f"expert tensor parallel size {etp} must divide moe_intermediate_size ({spec.moe_ffn_hidden_size})"
        )
    return dict(
        num_moe_experts=spec.num_experts,
        moe_router_topk=spec.moe_router_topk,
        moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
        moe_router_score_function=spec.router_score_function,
        # HF: softmax over all experts, top-k, then renormalised iff norm_topk_prob (= megatron's post-top-k softmax)
        moe_router_pre_softmax=not spec.norm_topk_prob and spec.router_score_function == "softmax",
        moe_router_enable_expert_bias=spec.router_expert_bias,
        # the bias is the checkpoint's and is kept: HF's forward (and SGLang's) only reads it
        moe_router_bias_update_rate=0.0,
        moe_router_topk_scaling_factor=spec.router_scaling_factor,
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=moe_aux_loss_coeff(spec, args),
        moe_grouped_gemm=False,  # SequentialMLP: local modules only (grouped GEMM needs TE or the grouped_gemm kernels)
        moe_shared_expert_intermediate_size=spec.shared_expert_intermediate_size,
        moe_shared_expert_gate=spec.shared_expert_intermediate_size is not None and spec.shared_expert_gate,
        moe_shared_expert_overlap=False,
        # dense layers between the sparse ones (mlp_only_layers, decoder_sparse_step): megatron's per-layer pattern
        **({"moe_layer_freq": list(spec.moe_layer_pattern)} if spec.moe_layer_pattern else {}),
        moe_permute_fusion=False,
    )
