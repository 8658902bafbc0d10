"""The deployment plan: a pure function from (args, resolved SGLang config) to engines and routers.

Why a separate, pure step: `slime plan` prints exactly what `slime train` will start, property tests check
the invariants (GPU ranges partition the rollout GPUs, ports unique, one router per model) without Ray, and
the launcher only executes the plan. GPU indices are *logical* placement-group indices (bundles sorted by node
address then GPU id, docs/architecture.md#the-placement-group); the launcher maps them to physical ids. Ports
are planned from fixed bases so the plan is deterministic; the launcher may move a planned port that is busy
at launch time.
"""

from __future__ import annotations

import json
from argparse import Namespace
from dataclasses import asdict, dataclass, field
from typing import Any

from slime.backends.sglang.sglang_config import SGLangConfig

ENGINE_PORT_BASE = 15000
ENGINE_PORT_STRIDE = 3  # http, nccl, bootstrap (prefill) per engine
ROUTER_PORT_BASE = 30000
ROUTER_PORT_STRIDE = 2  # http, prometheus


@dataclass(frozen=True)
class EnginePlan:
    model: str
    group: int  # index of the group within its model
    rank: int  # global engine index over all models (seeds, log names)
    worker_type: str  # regular | prefill | decode
    gpu_start: int  # logical GPU index within the rollout range
    num_gpus: int  # GPUs of the whole engine (tp x pp), may span nodes
    base_gpu_id: int  # logical GPU index in the placement group (rollout offset + gpu_start)
    nnodes: int
    port: int
    nccl_port: int
    bootstrap_port: int | None
    disaggregation_mode: str | None
    enable_memory_saver: bool
    needs_offload: bool
    model_path: str
    overrides: dict[str, Any] = field(default_factory=dict)

    @property
    def gpu_range(self) -> tuple[int, int]:
        return self.gpu_start, self.gpu_start + self.num_gpus


@dataclass(frozen=True)
class GroupPlan:
    model: str
    group: int
    worker_type: str
    gpu_start: int
    num_gpus: int
    num_gpus_per_engine: int
    num_engines: int
    needs_offload: bool


@dataclass(frozen=True)
class RouterPlan:
    model: str
    pd: bool
    host: str
    port: int
    prometheus_port: int
    reuse_user_router: bool  # the first model may reuse a running router given by --sglang-router-ip/port
    update_weights: bool
    receives_weights: bool


@dataclass(frozen=True)
class DeploymentPlan:
    rollout_num_gpus: int
    rollout_offset: int
    actor_num_gpus: int
    groups: tuple[GroupPlan, ...]
    engines: tuple[EnginePlan, ...]
    routers: tuple[RouterPlan, ...]

    def engines_of(self, model: str) -> list[EnginePlan]:
        return [e for e in self.engines if e.model == model]

    def router_of(self, model: str) -> RouterPlan:
        return next(r for r in self.routers if r.model == model)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def _actor_gpus(args: Namespace) -> int:
    if args.debug_rollout_only:
        return 0  # inference alone: the placement group holds only rollout GPUs, engines start at 0
    return args.actor_num_nodes * args.actor_num_gpus_per_node


def rollout_offset(args: Namespace) -> int:
    """Where rollout GPUs start in the placement group: after the train GPUs, or at 0 when they share them."""
    if args.debug_rollout_only or args.colocate:
        return 0
    return _actor_gpus(args)


def build_plan(args: Namespace, config: SGLangConfig, host: str = "127.0.0.1") -> DeploymentPlan:
    """Engines per group in YAML order with cumulative GPU offsets; one router per model."""
    offset = rollout_offset(args)
    actor = _actor_gpus(args)
    offload = bool(args.offload_rollout)
    gpn = args.num_gpus_per_node
    groups: list[GroupPlan] = []
    engines: list[EnginePlan] = []
    cursor = 0
    for model in config.models:
        for gi, g in enumerate(model.server_groups):
            # "needs offload" iff offload_rollout and the group's first GPU is inside the Megatron range
            needs_offload = offload and offset + cursor < actor
            n = 0 if g.is_placeholder else g.num_gpus // g.num_gpus_per_engine
            groups.append(
                GroupPlan(model.name, gi, g.worker_type, cursor, g.num_gpus, g.num_gpus_per_engine, n, needs_offload)
            )
            for k in range(n):
                rank = len(engines)
                port = ENGINE_PORT_BASE + ENGINE_PORT_STRIDE * rank
                start = cursor + k * g.num_gpus_per_engine
                engines.append(
                    EnginePlan(
                        model=model.name, group=gi, rank=rank, worker_type=g.worker_type, gpu_start=start,
                        num_gpus=g.num_gpus_per_engine, base_gpu_id=offset + start,
                        nnodes=max(1, g.num_gpus_per_engine // gpn) if g.num_gpus_per_engine > gpn else 1,
                        port=port, nccl_port=port + 1,
                        bootstrap_port=port + 2 if g.worker_type == "prefill" else None,
                        disaggregation_mode=g.worker_type if g.worker_type in ("prefill", "decode") else None,
                        enable_memory_saver=needs_offload, needs_offload=needs_offload,
                        model_path=g.model_path, overrides=dict(g.overrides),
                    )
                )  # fmt: skip
            cursor += g.num_gpus
    routers = []
    user_router = bool(args.sglang_router_ip and args.sglang_router_port)
    for i, model in enumerate(config.models):
        reuse = user_router and i == 0
        port = int(args.sglang_router_port) if reuse else ROUTER_PORT_BASE + ROUTER_PORT_STRIDE * i
        routers.append(
            RouterPlan(
                model=model.name, pd=model.is_pd, host=args.sglang_router_ip if reuse else host, port=port,
                prometheus_port=ROUTER_PORT_BASE + ROUTER_PORT_STRIDE * i + 1, reuse_user_router=reuse,
                update_weights=model.update_weights, receives_weights=model.receives_weights,
            )
        )  # fmt: skip
    return DeploymentPlan(cursor, offset, actor, tuple(groups), tuple(engines), tuple(routers))


def planned_ports(plan: DeploymentPlan) -> list[int]:
    """Every port the plan claims (tests check they are distinct)."""
    ports: list[int] = []
    for e in plan.engines:
        ports += [e.port, e.nccl_port] + ([e.bootstrap_port] if e.bootstrap_port is not None else [])
    for r in plan.routers:
        ports += [r.port, r.prometheus_port]
    return ports
