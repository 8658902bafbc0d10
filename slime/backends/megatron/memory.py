"""The memory plan: bytes of every buffer on each training GPU and its host, phase by phase (pure arithmetic).

`slime plan` prints it before anything launches (docs/memory.md), property tests check it against the
simulator's memory accountant (tests/property/test_memory_plan.py), and `bench/offload_memory_gpu.py` against
`torch.cuda.max_memory_allocated` on a GPU. Everything is per rank; ranks of one pipeline stage are identical
(TP splits every tensor evenly, DP and CP replicate the model), so one column per stage is the whole story.

Per trained model with N parameters on the rank, d the distributed optimizer's sharding (dp × cp, else 1) and
p the param bytes (2 in bf16, 4 in fp32), an awake trainer holds on its GPU

    params p·N,  fp32 grads 4·N,  fp32 master params 4·⌈N/d⌉ (bf16 only),  Adam m and v 4·⌈N/d⌉ each

plus its activations: `train_tokens` tokens of a micro-batch through the layers (saved for backward), the
vocabulary-wide loss temporaries of the actor, and at the optimizer step the foreach Adam's one temporary of
4·⌈N/d⌉ (torch's AdamW allocates √v for the whole group at once). A sleeping trainer holds nothing on the GPU;
its host keeps, by offload policy (slime/backends/megatron/offload.py):

    v0.3.0 (default)  pinned weight copy p·N (kept awake too) + optimizer state (4 + 4 + 4 bf16)·⌈N/d⌉
    legacy            the whole region p·N + 4·N + optimizer, and one more unpinned copy p·N of the weights
    none              (no --offload-train) nothing: the trainer never sleeps

(MoE: N counts this rank's `num_experts / ep` experts, and their optimizer state is sharded over the
expert-data-parallel group, tp·dp·cp / ep ranks, instead of d; activations hold top-k copies of each token's MLP)

so the default saves (p + 4)·N bytes of host per rank for every trained model, 6 B/param in bf16 (actor and
critic alike: each has its own weight copy under either policy). The reference policy (KL) adds a host copy
p·N under both policies, and its log-prob pass a transient one (the actor's weights while swapped out).

Phases of one colocated step: `rollout` (engines hold weights + KV: `engine_fraction` of the GPU), PPO's
`critic_values` and `critic_train`, `actor_log_probs`, `actor_train`, `weight_sync` (engines hold their weights
again; the sleeping actor sends from its host copy, one flattened bucket at a time on the host).
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

POLICIES = ("v0.3.0", "legacy", "none")
PHASES = ("rollout", "critic_values", "critic_train", "actor_log_probs", "actor_train", "weight_sync")
GiB = 2**30


@dataclass(frozen=True)
class ModelShape:
    """What the byte counts need from an HF config (`hf_config.HFModelSpec` has these fields)."""

    vocab_size: int
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    qkv_bias: bool
    qk_layernorm: bool
    tie_word_embeddings: bool
    # MoE (0 for dense models): every layer's MLP is a router, the experts and, for Qwen2-MoE, a gated shared expert
    num_experts: int = 0
    moe_router_topk: int = 0
    moe_ffn_hidden_size: int = 0
    shared_expert_intermediate_size: int = 0

    @classmethod
    def of(cls, spec: Any) -> ModelShape:
        return cls(**{f: getattr(spec, f, None) or 0 if f in _MOE_FIELDS else getattr(spec, f) for f in cls.__dataclass_fields__})  # fmt: skip


_MOE_FIELDS = ("num_experts", "moe_router_topk", "moe_ffn_hidden_size", "shared_expert_intermediate_size")


def mlp_params_per_layer(shape: ModelShape, tp: int, ep: int = 1) -> tuple[int, int]:
    """(dense, expert) parameters of one layer's MLP on a rank: dense ones are TP-sharded (router and shared
    gate replicated); expert ones are this rank's `num_experts / ep` experts, whole (expert TP 1)."""
    h = shape.hidden_size
    if not shape.num_experts:
        return 3 * shape.ffn_hidden_size * h // tp, 0
    dense = shape.num_experts * h  # router
    if shape.shared_expert_intermediate_size:
        dense += 3 * shape.shared_expert_intermediate_size * h // tp + h  # shared expert and its sigmoid gate
    return dense, shape.num_experts // ep * 3 * shape.moe_ffn_hidden_size * h


def padded_vocab(vocab: int, tp: int) -> int:
    return -(-vocab // tp) * tp


def params_per_rank(shape: ModelShape, tp: int, pp: int, pp_rank: int, *, critic: bool = False, ep: int = 1) -> int:
    """Parameters of one rank of stage `pp_rank`: megatron-core's local-spec GPTModel, TP-sharded.

    Embedding (first stage) and output layer (last stage) are vocab-parallel over the vocabulary padded to a
    multiple of tp; a tied model's last stage keeps its own copy of the output weight when pp > 1. The critic
    unties, and its output layer is the value head (hidden + 1, replicated). MoE: `ep` splits the experts."""
    return sum(param_split(shape, tp, pp, pp_rank, critic=critic, ep=ep))


def param_split(
    shape: ModelShape, tp: int, pp: int, pp_rank: int, *, critic: bool = False, ep: int = 1
) -> tuple[int, int]:
    """`params_per_rank` as (dense, expert): the distributed optimizer shards the two over different groups."""
    h = shape.hidden_size
    q, kv = shape.num_attention_heads * shape.kv_channels, shape.num_query_groups * shape.kv_channels
    if shape.num_layers % pp:
        raise ValueError(f"{shape.num_layers} layers do not split into {pp} pipeline stages")
    per_layer = 2 * h  # input_layernorm, pre_mlp_layernorm (replicated)
    per_layer += (q + 2 * kv) * h // tp + (q + 2 * kv) // tp * shape.qkv_bias  # linear_qkv (+ bias)
    per_layer += 2 * shape.kv_channels * shape.qk_layernorm  # q/k layernorm over the head dim
    dense_mlp, expert_mlp = mlp_params_per_layer(shape, tp, ep)
    per_layer += q * h // tp + dense_mlp  # linear_proj, the MLP's dense part
    layers = shape.num_layers // pp
    n = per_layer * layers
    vocab_rows = padded_vocab(shape.vocab_size, tp) // tp * h
    first, last = pp_rank == 0, pp_rank == pp - 1
    if first:
        n += vocab_rows
    if last:
        n += h  # final layernorm
        if critic:
            n += h + 1
        elif not shape.tie_word_embeddings or pp > 1:
            n += vocab_rows
    return n, expert_mlp * layers


def _mlp_width_per_token(shape: ModelShape, tp: int) -> int:
    """fc1 (gate + up) plus SwiGLU output widths one token occupies: for MoE, once per routed expert (top-k
    copies, whole experts) plus the permuted hidden copies, and the TP-sharded shared expert."""
    if not shape.num_experts:
        return 3 * shape.ffn_hidden_size // tp
    routed = shape.moe_router_topk * (3 * shape.moe_ffn_hidden_size + shape.hidden_size)
    return routed + 3 * shape.shared_expert_intermediate_size // tp


def activation_bytes_per_token(shape: ModelShape, tp: int, p: int) -> int:
    """Bytes one token leaves saved for backward in one layer (local spec, SDPA attention, no recompute):
    the layer input and both norm outputs and the residual (4·h, replicated over TP), q/k/v, the rotated q/k,
    the attention output, the fc1 output (gate + up) and the SwiGLU output (TP-sharded; MoE: per routed expert)."""
    h = shape.hidden_size
    q, kv = shape.num_attention_heads * shape.kv_channels, shape.num_query_groups * shape.kv_channels
    if not shape.num_experts:
        return p * (4 * h + ((q + 2 * kv) + (q + kv) + q + 3 * shape.ffn_hidden_size) // tp)
    return p * (4 * h + ((q + 2 * kv) + (q + kv) + q) // tp + _mlp_width_per_token(shape, tp))


def forward_bytes_per_token(shape: ModelShape, tp: int, p: int) -> int:
    """Peak transient bytes per token of a no-grad layer forward (its input, the fc1 and SwiGLU outputs)."""
    return p * (2 * shape.hidden_size + _mlp_width_per_token(shape, tp))


def loss_bytes_per_token(shape: ModelShape, tp: int, p: int, *, train: bool) -> int:
    """The actor's vocabulary-wide temporaries per token: the logits (p), their fp32 copy and the fp32
    temporaries of the log-softmax; 4 of them in no-grad log-prob passes, 6 in training (entropy, backward)."""
    return padded_vocab(shape.vocab_size, tp) // tp * (p + 4 * (6 if train else 3))


@dataclass(frozen=True)
class MemoryConfig:
    """One training job's memory-relevant settings (`config_from_args` fills it from the flags)."""

    actor: ModelShape
    critic: ModelShape | None = None
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1  # MoE: experts split over ep ranks; their optimizer state over the expert-DP group
    reference: bool = False
    distributed_optimizer: bool = True
    bf16: bool = True
    policy: str = "v0.3.0"
    colocated: bool = True
    engine_fraction: float = 0.8
    gpu_capacity: int = 80 * GiB
    host_capacity: int | None = None  # per node
    gpus_per_node: int = 8
    train_tokens: int = 4096
    logprob_tokens: int = 4096
    adam_foreach: bool = True
    bucket_bytes: int = 512 * 2**20
    engine_params: int | None = None  # the engine's model (default: the actor's whole model), bf16, / engine_tp
    engine_tp: int = 1

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")


@dataclass
class RoleState:
    """One trained model on one rank: its buffers (bytes) awake on the GPU, and on the host by state."""

    role: str
    params: int  # parameter count
    gpu: dict[str, int]
    train_act: int
    fwd_act: int
    opt_temp: int
    host_asleep: dict[str, int]
    host_awake: dict[str, int]

    @property
    def static(self) -> int:
        return sum(self.gpu.values())


@dataclass
class PhaseUsage:
    phase: str
    gpu: dict[str, int]  # "<process>/<buffer>" -> bytes at the phase's peak
    host: dict[str, int]

    @property
    def gpu_total(self) -> int:
        return sum(self.gpu.values())

    @property
    def host_total(self) -> int:
        return sum(self.host.values())


@dataclass
class StagePlan:
    """Every rank of pipeline stage `pp_rank` (tp × dp × cp identical ranks)."""

    pp_rank: int
    roles: dict[str, RoleState]
    phases: list[PhaseUsage]
    peak_gpu: int = 0
    peak_gpu_phase: str = ""
    peak_host: int = 0
    peak_host_phase: str = ""

    def phase(self, name: str) -> PhaseUsage:
        return next(p for p in self.phases if p.phase == name)


@dataclass
class MemoryPlan:
    config: MemoryConfig
    stages: list[StagePlan]
    problems: list[str] = field(default_factory=list)

    @property
    def feasible(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": asdict(self.config),
            "feasible": self.feasible,
            "problems": list(self.problems),
            "stages": [
                {
                    "pp_rank": s.pp_rank,
                    "ranks": self.config.tp * self.config.dp * self.config.cp,
                    "params": {r: st.params for r, st in s.roles.items()},
                    "peak_gpu_bytes": s.peak_gpu,
                    "peak_gpu_phase": s.peak_gpu_phase,
                    "peak_host_bytes": s.peak_host,
                    "peak_host_phase": s.peak_host_phase,
                    "phases": [
                        {
                            "phase": p.phase,
                            "gpu": p.gpu,
                            "host": p.host,
                            "gpu_total": p.gpu_total,
                            "host_total": p.host_total,
                        }
                        for p in s.phases
                    ],  # fmt: skip
                }
                for s in self.stages
            ],
        }


def _role_state(cfg: MemoryConfig, role: str, shape: ModelShape, pp_rank: int) -> RoleState:
    dense, expert = param_split(shape, cfg.tp, cfg.pp, pp_rank, critic=role == "critic", ep=cfg.ep)
    n = dense + expert
    d = cfg.dp * cfg.cp if cfg.distributed_optimizer else 1
    # expert params are replicated over expert-DP = world / (ep × pp) ranks (expert TP 1), not over dp × cp
    d_expert = cfg.tp * cfg.dp * cfg.cp // cfg.ep if cfg.distributed_optimizer else 1
    shard = math.ceil(dense / d) + (math.ceil(expert / d_expert) if expert else 0)
    p = 2 if cfg.bf16 else 4
    gpu = {"params": p * n, "grads": 4 * n, "master": 4 * shard if cfg.bf16 else 0, "adam_m": 4 * shard,
           "adam_v": 4 * shard}  # fmt: skip
    optimizer = gpu["master"] + gpu["adam_m"] + gpu["adam_v"]
    layers = shape.num_layers // cfg.pp
    in_flight = cfg.pp - pp_rank  # 1F1B: stage s holds the activations of pp - s micro-batches at most
    last = pp_rank == cfg.pp - 1
    act = in_flight * cfg.train_tokens * layers * activation_bytes_per_token(shape, cfg.tp, p)
    fwd = cfg.logprob_tokens * forward_bytes_per_token(shape, cfg.tp, p)
    if role == "actor" and last:
        act += cfg.train_tokens * loss_bytes_per_token(shape, cfg.tp, p, train=True)
        # the last hidden state stays while the logits and their temporaries exist
        fwd = max(
            fwd, cfg.logprob_tokens * (p * shape.hidden_size + loss_bytes_per_token(shape, cfg.tp, p, train=False))
        )
    if role == "critic":
        fwd = cfg.train_tokens * forward_bytes_per_token(shape, cfg.tp, p)  # the critic reads training batches
    opt_temp = 4 * shard if cfg.adam_foreach else 0
    if cfg.policy == "v0.3.0":
        host_asleep = {"weights_pinned": p * n, "optimizer_backup": optimizer}
        host_awake = {"weights_pinned": p * n}
    elif cfg.policy == "legacy":
        host_asleep = {"region_backup": p * n + 4 * n + optimizer, "weights_copy": p * n}
        host_awake = {}
    else:
        host_asleep, host_awake = {}, {}
    if role == "actor" and cfg.reference:
        host_asleep["reference"] = host_awake["reference"] = p * n
    return RoleState(role, n, gpu, act, fwd, opt_temp, host_asleep, host_awake)


def _engine_bytes(cfg: MemoryConfig, phase: str) -> dict[str, int]:
    if not cfg.colocated:
        return {}
    weights = engine_weight_bytes(cfg)
    if phase == "rollout":
        return {"engine/weights+kv": max(int(cfg.engine_fraction * cfg.gpu_capacity), weights)}
    if phase == "weight_sync":
        return {"engine/weights": weights}
    return {}


def engine_weight_bytes(cfg: MemoryConfig) -> int:
    """An engine's bf16 weights on one of its GPUs (the model split over the engine's TP)."""
    n = cfg.engine_params if cfg.engine_params is not None else full_params(cfg.actor)
    return 2 * n // cfg.engine_tp


def full_params(shape: ModelShape) -> int:
    """The whole model's parameter count (TP 1, one stage)."""
    return params_per_rank(shape, 1, 1, 0)


def _phase(cfg: MemoryConfig, name: str, roles: dict[str, RoleState]) -> PhaseUsage:
    """The GPU and host bytes at the peak of phase `name`: who is awake and what they allocate."""
    active = {"critic_values": "critic", "critic_train": "critic", "actor_log_probs": "actor",
              "actor_train": "actor"}.get(name)  # fmt: skip
    gpu: dict[str, int] = dict(_engine_bytes(cfg, name))
    host: dict[str, int] = {}
    for role, st in roles.items():
        awake = role == active or cfg.policy == "none"
        if awake:
            gpu.update({f"{role}/{k}": v for k, v in st.gpu.items()})
        for k, v in (st.host_awake if awake else st.host_asleep).items():
            host[f"{role}/{k}"] = v
    if active is not None:
        st = roles[active]
        if name.endswith("_train"):
            temp = ("activations", st.train_act) if st.train_act >= st.opt_temp else ("adam_temp", st.opt_temp)
            gpu[f"{active}/{temp[0]}"] = temp[1]
        else:
            gpu[f"{active}/forward"] = st.fwd_act
        if name == "actor_log_probs" and cfg.reference:
            host["actor/weights_swapped_out"] = (2 if cfg.bf16 else 4) * st.params  # during the reference pass
    if name == "weight_sync":
        total = full_params(cfg.actor) * 2
        host["actor/sync_bucket"] = min(cfg.bucket_bytes, total)
    return PhaseUsage(name, gpu, host)


def build_memory_plan(cfg: MemoryConfig) -> MemoryPlan:
    """The plan of every pipeline stage; configurations that cannot fit are listed in `problems`."""
    stages = []
    problems = []
    names = [p for p in PHASES if cfg.critic is not None or not p.startswith("critic")]
    for pp_rank in range(cfg.pp):
        roles = {"actor": _role_state(cfg, "actor", cfg.actor, pp_rank)}
        if cfg.critic is not None:
            roles = {"critic": _role_state(cfg, "critic", cfg.critic, pp_rank), **roles}
        phases = [_phase(cfg, name, roles) for name in names]
        stage = StagePlan(pp_rank, roles, phases)
        top = max(phases, key=lambda u: u.gpu_total)
        stage.peak_gpu, stage.peak_gpu_phase = top.gpu_total, top.phase
        top = max(phases, key=lambda u: u.host_total)
        stage.peak_host, stage.peak_host_phase = top.host_total, top.phase
        for u in phases:
            if u.gpu_total > cfg.gpu_capacity:
                problems.append(
                    f"stage {pp_rank}: {u.phase} needs {u.gpu_total / GiB:.1f} GiB of GPU memory per rank, "
                    f"more than the {cfg.gpu_capacity / GiB:.1f} GiB there are"
                )
        stages.append(stage)
    if cfg.colocated and engine_weight_bytes(cfg) > cfg.engine_fraction * cfg.gpu_capacity:
        problems.append(
            f"engine weights ({engine_weight_bytes(cfg) / GiB:.1f} GiB per GPU) exceed its memory fraction "
            f"({cfg.engine_fraction} of {cfg.gpu_capacity / GiB:.1f} GiB): no room for a KV cache"
        )
    if cfg.host_capacity is not None:
        per_node = min(cfg.gpus_per_node, cfg.tp * cfg.pp * cfg.dp * cfg.cp)
        worst = max(s.peak_host for s in stages) * per_node
        if worst > cfg.host_capacity:
            problems.append(
                f"host: {per_node} ranks per node need up to {worst / GiB:.1f} GiB, more than the "
                f"{cfg.host_capacity / GiB:.1f} GiB of a node"
            )
    return MemoryPlan(cfg, stages, problems)


def host_saving_per_rank(plan_new: MemoryPlan, plan_legacy: MemoryPlan, pp_rank: int = 0) -> int:
    """Host bytes the default policy saves over legacy on a rank while its trainers sleep (the rollout)."""
    return (
        plan_legacy.stages[pp_rank].phase("rollout").host_total - plan_new.stages[pp_rank].phase("rollout").host_total
    )


def config_from_args(
    args: Any,
    actor: Any,
    critic: Any | None,
    *,
    gpu_capacity: int,
    host_capacity: int | None = None,
    policy: str | None = None,
    train_tokens: int | None = None,
) -> MemoryConfig:
    """The `MemoryConfig` of a job's flags; `actor` / `critic` are model shapes (`HFModelSpec` or `ModelShape`)."""
    world = args.actor_num_nodes * args.actor_num_gpus_per_node
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    dp = max(1, world // (tp * pp * cp))
    if train_tokens is None:
        if args.use_dynamic_batch_size and args.max_tokens_per_gpu:
            train_tokens = args.max_tokens_per_gpu
        else:
            seq = (args.rollout_max_context_len or 0) or ((args.rollout_max_prompt_len or 0) + (args.rollout_max_response_len or 0))  # fmt: skip
            train_tokens = max(1, args.micro_batch_size * max(seq, 1) // cp)
    if policy is None:
        policy = ("legacy" if args.legacy_offload else "v0.3.0") if args.offload_train else "none"
    distributed = args.use_distributed_optimizer if args.use_distributed_optimizer is not None else True
    fraction = args.sglang_mem_fraction_static if args.sglang_mem_fraction_static is not None else 0.8
    return MemoryConfig(
        actor=ModelShape.of(actor),
        critic=ModelShape.of(critic) if critic is not None else None,
        tp=tp,
        pp=pp,
        dp=dp,
        cp=cp,
        ep=args.expert_model_parallel_size,
        reference=bool(args.use_kl_loss or args.kl_coef),
        distributed_optimizer=bool(distributed),
        bf16=bool(args.bf16),
        policy=policy,
        colocated=bool(args.colocate),
        engine_fraction=float(fraction),
        gpu_capacity=int(gpu_capacity),
        host_capacity=host_capacity,
        gpus_per_node=args.num_gpus_per_node,
        train_tokens=int(train_tokens),
        logprob_tokens=int(args.log_probs_max_tokens_per_gpu or train_tokens),
        bucket_bytes=int(args.update_weight_buffer_size),
        engine_tp=args.rollout_num_gpus_per_engine,
    )
