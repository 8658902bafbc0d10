"""Build the megatron-core GPTModel for `--hf-checkpoint` (local spec, slime's SDPA core attention).

Why the local spec: TransformerEngine is unavailable (CPU; a source build on GPU hosts), and the local
spec works everywhere once its core attention is swapped for `SDPACoreAttention` (packed sequences + speed).

Use (the train actor, after `initialize.init_megatron`):

    spec = read_hf_config(args.hf_checkpoint)
    model = build_gpt_model(args, spec)                      # this rank's TP shard / PP stage, fp32 on CPU
    load_hf_weights(model, args.hf_checkpoint, spec, ps)    # hf_weights.py
    logits = model(tokens, position_ids, None, packed_seq_params=psp)   # [1, t, padded_vocab / tp]

For megatron's `get_model`-style wrappers (DDP, virtual pipeline) use `model_provider(args, spec)`, a
callable `(pre_process, post_process, vp_stage=None) -> GPTModel`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from megatron.core import parallel_state as mpu
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

from slime.backends.megatron.attention import SDPACoreAttention
from slime.backends.megatron.hf_config import (
    HFModelSpec,
    padded_vocab_size,
    read_hf_config,
    transformer_config_kwargs,
)
from slime.backends.megatron.rope import use_positional_rope
from slime.backends.megatron.wgrad_fusion import use_wgrad_accumulation_fusion

logger = logging.getLogger(__name__)


class RMSNorm(torch.nn.RMSNorm):
    """The local spec's RMSNorm (`torch.nn.RMSNorm`, as megatron's `WrappedTorchNorm` builds it) that also runs
    under sequence parallelism.

    Why: `WrappedTorchNorm` asserts `not config.sequence_parallel`, yet an RMSNorm needs nothing from its TP peers:
    it normalises each token over the hidden dimension, so a rank holding a slice of the sequence computes its
    tokens' rows exactly. Only its weight's gradient is then partial (each TP rank saw its own tokens): the
    weight is marked `sequence_parallel`, and megatron's `finalize_model_grads` sums such gradients over TP.
    `sequence_parallel_input=False` is for the Q/K norms, which run on whole-sequence heads after the QKV
    projection's gather (megatron sums their gradients over TP by name already)."""

    def __init__(
        self,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "RMSNorm",
        sequence_parallel_input: bool = True,
    ) -> None:
        if config.normalization != "RMSNorm" or config.layernorm_zero_centered_gamma:
            raise ValueError(f"slime's RMSNorm cannot be {config.normalization} (zero-centered gamma: "
                             f"{config.layernorm_zero_centered_gamma})")  # fmt: skip
        # in the params' dtype, as megatron's Float16Module casts every parameter in bf16 training (slime v0.3.0's
        # norms are bf16 too); torch's fused RMSNorm also needs matching dtypes, though on the H200 the step time
        # did not change measurably (bench/gpu_train.py --variant fp32-norms trainer; docs/performance.md)
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        self.weight.sequence_parallel = bool(config.sequence_parallel and sequence_parallel_input)


def gpt_layer_spec(spec: HFModelSpec, moe: bool | None = None) -> ModuleSpec:
    """megatron-core's local GPT layer spec (RMSNorm, SwiGLU MLP) with `SDPACoreAttention` as core attention and
    slime's `RMSNorm` (which, unlike the wrapped torch norm, allows sequence parallelism) for every norm.

    MoE checkpoints get megatron's MoE layer from the same local spec: `TopKRouter`, `SequentialMLP` experts (one
    local `MLP` per expert: no grouped GEMM, which needs TE or the grouped_gemm kernels) and, for Qwen2-MoE, a
    `SharedExpertMLP` with its gate. `moe=False` gives the dense layer of a mixed stack."""
    moe = spec.is_moe if moe is None else moe
    layer = get_gpt_layer_local_spec(
        num_experts=spec.num_experts if moe else None,
        moe_grouped_gemm=False,
        normalization="RMSNorm",
        qk_layernorm=spec.qk_layernorm,
    )
    sub = layer.submodules
    sub.input_layernorm = sub.pre_mlp_layernorm = RMSNorm
    attn = sub.self_attention.submodules
    attn.core_attention = SDPACoreAttention
    if spec.qk_layernorm:
        attn.q_layernorm = attn.k_layernorm = ModuleSpec(module=RMSNorm, params={"sequence_parallel_input": False})
    return layer


def gpt_block_spec(
    spec: HFModelSpec, config: TransformerConfig, vp_stage: int | None = None
) -> TransformerBlockSubmodules:
    """This stage's layers plus the final norm: given as a block so that the final norm is slime's `RMSNorm`
    (from a layer spec alone megatron picks `WrappedTorchNorm`, which refuses sequence parallelism)."""
    layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    if not spec.moe_layer_pattern:
        return TransformerBlockSubmodules(layer_specs=[gpt_layer_spec(spec)] * layers, layer_norm=RMSNorm)
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    offset = int(get_transformer_layer_offset(config, vp_stage=vp_stage))  # the global index of this stage's first
    pattern = spec.moe_layer_pattern[offset : offset + layers]
    return TransformerBlockSubmodules(layer_specs=[gpt_layer_spec(spec, bool(m)) for m in pattern], layer_norm=RMSNorm)


def _moe_without_transformer_engine() -> None:
    """megatron-core 0.16.1's router GEMM (`moe_utils.RouterGatingLinearFunction`) tests `te_general_gemm is not
    None`, but the name is only bound when TransformerEngine imports: without TE every MoE forward raises
    NameError. Bind it to None (megatron's own torch.mm fallback) when TE did not."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def build_transformer_config(args: Any, spec: HFModelSpec, **overrides: Any) -> TransformerConfig:
    kwargs = transformer_config_kwargs(spec, args)
    # on CUDA, weight gradients accumulate into the fp32 main grads inside the GEMM (wgrad_fusion.py)
    kwargs["gradient_accumulation_fusion"] = use_wgrad_accumulation_fusion()
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build_gpt_model(
    args: Any,
    spec: HFModelSpec | None = None,
    *,
    pre_process: bool | None = None,
    post_process: bool | None = None,
    vp_stage: int | None = None,
    config: TransformerConfig | None = None,
    share_embeddings: bool | None = None,
) -> GPTModel:
    """This rank's part of the model (TP shard, PP stage). Needs megatron's parallel state initialised.

    `share_embeddings` overrides the checkpoint's `tie_word_embeddings` (the critic unties: its output layer is
    replaced by a value head). `parallel_output=True`: logits stay vocab-parallel ([.., padded_vocab / tp]) as megatron's vocab-parallel
    cross-entropy expects; gather them over the TP group to see the whole vocabulary.
    """
    spec = spec or read_hf_config(args.hf_checkpoint)
    config = config or build_transformer_config(args, spec)
    if spec.is_moe:
        _moe_without_transformer_engine()
    if pre_process is None:
        pre_process = mpu.is_pipeline_first_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    if post_process is None:
        post_process = mpu.is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    model = GPTModel(
        config=config,
        transformer_layer_spec=gpt_block_spec(spec, config, vp_stage),
        vocab_size=padded_vocab_size(spec.vocab_size, config.tensor_model_parallel_size),
        max_sequence_length=spec.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=spec.tie_word_embeddings if share_embeddings is None else share_embeddings,
        position_embedding_type="rope",
        rotary_base=spec.rope_theta,
        rotary_percent=spec.rotary_percent,
        vp_stage=vp_stage,
    )
    scaled = None
    if spec.rope_type != "default":
        from slime.backends.megatron.rope_scaling import ScaledRope

        scaled = ScaledRope(spec.rope_fields)
        config.slime_rope_attention_factor = scaled.attention_factor  # read by rope.apply_packed_rope
    use_positional_rope(model, scaled)  # slime's packed rows number their tokens themselves (packing.py, rope.py)
    if spec.is_moe:
        track_router_balance(model)
    logger.info(
        "built GPTModel (%s, %d layers, pre=%s post=%s vp_stage=%s): %d local params",
        spec.model_type,
        spec.num_layers,
        pre_process,
        post_process,
        vp_stage,
        sum(p.numel() for p in model.parameters()),
    )
    return model


# megatron's tracker name for the router's switch load-balancing loss (moe_utils.save_to_aux_losses_tracker)
_BALANCE = "load_balancing_loss"


def track_router_balance(model: torch.nn.Module) -> None:
    """Record every router's load-balancing loss in megatron's aux-loss tracker even when it is no loss term.

    Why: megatron computes (and tracks) the switch load-balancing loss only when `--moe-aux-loss-coeff` > 0, but
    expert imbalance is worth watching in any RL run. Routers without the loss term get a forward hook that
    computes the same quantity with megatron's functions, without gradient, on training forwards only (as
    megatron does); `moe_load_balancing_loss` reads both kinds."""
    from megatron.core.transformer.moe.router import TopKRouter

    for module in model.modules():
        if isinstance(module, TopKRouter) and not module.is_aux_loss_enabled():
            module.register_forward_hook(_record_balance)


def _record_balance(router: Any, inputs: tuple[Any, ...], output: Any) -> None:
    if not (router.training and torch.is_grad_enabled()):
        return
    from megatron.core.transformer.moe import moe_utils

    experts, topk = router.config.num_moe_experts, router.topk
    with torch.no_grad():
        logits = router.gating(inputs[0]).view(-1, experts)
        routing_map, scores = moe_utils.compute_routing_scores_for_aux_loss(logits, topk, router.score_function)
        per_expert, _, total = moe_utils.get_tokens_per_expert_and_token_count(
            routing_map, router.tp_cp_group, topk=topk
        )
        loss = moe_utils.switch_load_balancing_loss_func(scores, per_expert, total, topk, experts, 1.0)
    moe_utils.save_to_aux_losses_tracker(
        _BALANCE, loss, router.layer_number, router.config.num_layers, reduce_group=router.tp_cp_group
    )


def clear_moe_tracker() -> None:
    """Forget what the routers recorded (before an optimizer step's forward-backward)."""
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

    clear_aux_losses_tracker()


def moe_load_balancing_loss(ps: Any, num_microbatches: int, num_layers: int) -> float:
    """The routers' switch load-balancing loss since `clear_moe_tracker`, per layer and micro-batch, as megatron
    logs it (without its coefficient): summed over TP × CP (each rank holds its tokens' share) and PP (each stage
    its layers), averaged over DP. A collective over those groups; clears the tracker."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    tracker = get_moe_layer_wise_logging_tracker().get(_BALANCE)
    values = torch.zeros(num_layers, dtype=torch.float64)
    if tracker is not None:
        values += tracker["values"].detach().to("cpu", torch.float64)
    for dim in ("tp", "cp", "pp"):
        ps.all_reduce(values, "sum", dim)
    ps.all_reduce(values, "avg", "dp")
    clear_moe_tracker()
    return float(values.sum()) / (max(num_microbatches, 1) * num_layers)


def model_provider(args: Any, spec: HFModelSpec | None = None) -> Callable[..., GPTModel]:
    """A megatron-style provider `(pre_process, post_process, vp_stage=None) -> GPTModel` (one config shared)."""
    spec = spec or read_hf_config(args.hf_checkpoint)
    config = build_transformer_config(args, spec)

    def provide(pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None) -> GPTModel:
        return build_gpt_model(
            args, spec, pre_process=pre_process, post_process=post_process, vp_stage=vp_stage, config=config
        )

    return provide


def mask_padded_vocab(logits: torch.Tensor, vocab_size: int, tp_rank: int = 0) -> torch.Tensor:
    """Push the logits of TP vocabulary padding (columns >= `vocab_size`) to -1e4 so they get zero mass.

    `logits` is this rank's vocab-parallel shard [..., V_padded / tp]. A finite value rather than -inf keeps
    entropy terms (p * log p) free of NaN. Returns `logits` itself when this shard has no padding.
    """
    shard = logits.size(-1)
    start = tp_rank * shard
    if start + shard <= vocab_size:
        return logits
    column = torch.arange(start, start + shard, device=logits.device)
    return logits.masked_fill(column >= vocab_size, -1.0e4)
