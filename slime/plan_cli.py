"""`slime plan [--sglang-config X] [--json] <slime train flags>`: print the deployment plan, the train ranks' layout
(node, GPU, tp/cp/dp/pp rank) and the memory plan; start nothing.

Takes the same flags as `slime train` so what it prints is what training would launch. Planning must work
on a laptop without the checkpoint, so `--hf-checkpoint` need not exist and the batch-size flags that
`train` requires get neutral defaults here. The memory plan (slime/backends/megatron/memory.py, docs/memory.md)
needs the model's shape, so it is printed when `--hf-checkpoint`'s config.json is there: per pipeline stage and
phase, the GPU and host bytes of every buffer, the offload policies side by side, and the peaks per rank. A
configuration that cannot fit (`--gpu-memory-gib`, `--host-memory-gib` per node) makes the command exit 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import sys
import tempfile

from slime.backends.megatron.memory import MemoryPlan, build_memory_plan, config_from_args
from slime.backends.sglang.deployment import DeploymentPlan, build_plan
from slime.backends.sglang.sglang_config import resolve_sglang_config


def _parse(argv: list[str]) -> tuple[argparse.Namespace, bool]:
    """The train flags, validated as `slime train` would; `args.plan_capacity` carries the plan's own flags."""
    from slime.arguments import build_parser, reject_unknown, validate_args

    parser = build_parser()
    parser.prog = "slime plan"
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("--gpu-memory-gib", type=float, default=80.0, help="memory plan: bytes of one GPU")
    parser.add_argument("--host-memory-gib", type=float, default=None, help="memory plan: host memory of a node")
    args, unknown = parser.parse_known_args(argv)
    reject_unknown(parser, unknown)
    as_json = args.json
    capacity = {"gpu": int(args.gpu_memory_gib * 2**30), "host": args.host_memory_gib}
    del args.json, args.gpu_memory_gib, args.host_memory_gib
    if args.rollout_batch_size is None:
        args.rollout_batch_size = 1
    if args.num_rollout is None and args.num_epoch is None:
        args.num_rollout = 1
    hf = args.hf_checkpoint
    with tempfile.TemporaryDirectory() as stand_in:
        if hf is None or not os.path.isfile(os.path.join(hf, "config.json")):
            # validate_args checks the checkpoint exists; a plan only needs its path as a label.
            open(os.path.join(stand_in, "config.json"), "w").close()
            args.hf_checkpoint = stand_in
        validate_args(args, parser)
    args.hf_checkpoint = hf or "<--hf-checkpoint>"
    args.plan_capacity = capacity
    return args, as_json


def render_table(plan: DeploymentPlan, source: str | None) -> str:
    from rich.console import Console
    from rich.table import Table

    console = Console(file=io.StringIO(), width=160, record=True, force_terminal=False)
    title = f"slime plan: {source or 'flags (no --sglang-config)'}; rollout GPUs {plan.rollout_num_gpus} "
    title += f"at placement offset {plan.rollout_offset}"
    t = Table(title=title)
    for col in ("model", "group", "type", "engine", "GPUs", "base GPU", "nodes", "port", "bootstrap", "mode"):
        t.add_column(col)
    t.add_column("mem saver")
    for g in plan.groups:
        engines = [e for e in plan.engines if e.model == g.model and e.group == g.group]
        if not engines:
            t.add_row(g.model, str(g.group), g.worker_type, "-", f"[{g.gpu_start}, {g.gpu_start + g.num_gpus})",
                      "-", "-", "-", "-", "-", "-")  # fmt: skip
        for e in engines:
            lo, hi = e.gpu_range
            t.add_row(
                e.model, str(e.group), e.worker_type, str(e.rank), f"[{lo}, {hi})", str(e.base_gpu_id), str(e.nnodes),
                str(e.port), str(e.bootstrap_port or "-"), e.disaggregation_mode or "-", str(e.enable_memory_saver),
            )  # fmt: skip
    r = Table(title="routers (one per model)")
    for col in ("model", "mode", "address", "update_weights", "receives weight sync"):
        r.add_column(col)
    for rp in plan.routers:
        addr = f"{rp.host}:{rp.port}" + (" (user's router)" if rp.reuse_user_router else "")
        r.add_row(rp.model, "pd" if rp.pd else "regular", addr, str(rp.update_weights), str(rp.receives_weights))
    console.print(t)
    console.print(r)
    return console.export_text()


def train_ranks(args: argparse.Namespace) -> list[dict[str, int]]:
    """Every train rank's place: node, GPU on the node, and its rank along tp, cp, dp and pp, in megatron's
    order (tp-cp-ep-dp-pp: TP neighbours adjacent, stages farthest apart), and for MoE layouts along ep and etp
    of megatron's expert layout. `sender`: 1 for the rank of its
    stage that sends weights to the engines (dp = tp = cp = 0). Empty with --debug-rollout-only."""
    from slime.backends.megatron.rank_layout import expert_rank_groups, rank_groups, rank_of

    if args.debug_rollout_only:
        return []
    world, per_node = args.world_size, args.actor_num_gpus_per_node
    tp, cp, pp = args.tensor_model_parallel_size, args.context_parallel_size, args.pipeline_model_parallel_size
    groups = rank_groups(world, tp=tp, pp=pp, cp=cp)
    where = {d: rank_of(groups[d], world) for d in ("tp", "cp", "dp", "pp")}
    rows = []
    for r in range(world):
        row = {"rank": r, "node": r // per_node, "gpu": r % per_node}
        row.update({d: where[d][r][1] for d in ("tp", "cp", "dp", "pp")})
        row["sender"] = int(row["tp"] == row["cp"] == row["dp"] == 0)
        rows.append(row)
    ep, etp = args.expert_model_parallel_size, args.expert_tensor_parallel_size
    if ep > 1 or (etp or 1) > 1:  # MoE: where each rank sits in megatron's second (expert) layout
        experts = expert_rank_groups(world, tp=tp, pp=pp, ep=ep, etp=etp)
        for d in ("ep", "etp"):
            for r, (_, pos) in enumerate(rank_of(experts[d], world)):
                rows[r][d] = pos
    return rows


def render_ranks(rows: list[dict[str, int]]) -> str:
    from rich.console import Console
    from rich.table import Table

    console = Console(file=io.StringIO(), width=160, record=True, force_terminal=False)
    t = Table(title="train ranks (megatron order tp-cp-ep-dp-pp)")
    cols = ["rank", "node", "gpu", "tp", "cp", "dp", "pp"] + [c for c in ("ep", "etp") if rows and c in rows[0]]
    for col in [*cols, "sender"]:
        t.add_column(col, justify="right")
    for row in rows:
        t.add_row(*(str(row[c]) for c in cols), "yes" if row["sender"] else "")
    console.print(t)
    return console.export_text()


def memory_plans(args: argparse.Namespace) -> dict[str, MemoryPlan] | None:
    """The memory plan under each offload policy ("none" too when offload is off), or None without a model shape
    (no config.json at --hf-checkpoint) or without trainers (--debug-rollout-only)."""
    if args.debug_rollout_only or not os.path.isfile(os.path.join(args.hf_checkpoint, "config.json")):
        return None
    from slime.backends.megatron.hf_config import read_hf_config
    from slime.backends.megatron.roles import role_args
    from slime.ray.train_group import train_roles

    actor = read_hf_config(role_args(args, "actor").hf_checkpoint)
    critic = read_hf_config(role_args(args, "critic").hf_checkpoint) if "critic" in train_roles(args) else None
    cap = args.plan_capacity
    host = int(cap["host"] * 2**30) if cap["host"] is not None else None
    selected = config_from_args(args, actor, critic, gpu_capacity=cap["gpu"], host_capacity=host)
    policies = [selected.policy] + [p for p in ("v0.3.0", "legacy") if p != selected.policy]
    return {p: build_memory_plan(dataclasses.replace(selected, policy=p)) for p in policies}


def render_memory(plans: dict[str, MemoryPlan]) -> str:
    from rich.console import Console
    from rich.table import Table

    console = Console(file=io.StringIO(), width=160, record=True, force_terminal=False)
    selected = next(iter(plans))
    base = plans[selected]
    cfg = base.config
    gib = 2**30
    for stage in base.stages:
        roles = ", ".join(f"{r} {st.params / 1e9:.3g}B params" for r, st in stage.roles.items())
        title = (f"memory per rank, stage {stage.pp_rank} of {cfg.pp} ({cfg.tp * cfg.dp * cfg.cp} ranks: tp {cfg.tp} "
                 f"dp {cfg.dp} cp {cfg.cp}); {roles}; GPU {cfg.gpu_capacity / gib:.0f} GiB")  # fmt: skip
        t = Table(title=title)
        t.add_column("phase")
        t.add_column("GPU GiB", justify="right")
        t.add_column("largest GPU buffers")
        for p in plans:
            t.add_column(f"host GiB, {p}{' (selected)' if p == selected else ''}", justify="right")
        for u in stage.phases:
            top = sorted(u.gpu.items(), key=lambda kv: -kv[1])[:3]
            t.add_row(
                u.phase, f"{u.gpu_total / gib:.2f}", ", ".join(f"{k} {v / gib:.2f}" for k, v in top if v),
                *(f"{plans[p].stages[stage.pp_rank].phase(u.phase).host_total / gib:.2f}" for p in plans),
            )  # fmt: skip
        console.print(t)
        peaks = [f"{p}: host {plans[p].stages[stage.pp_rank].peak_host / gib:.2f} GiB" for p in plans]
        console.print(
            f"peaks per rank: GPU {stage.peak_gpu / gib:.2f} GiB ({stage.peak_gpu_phase}); " + "; ".join(peaks)
        )
    if base.feasible:
        console.print(f"feasible under {selected}: every phase fits")
    for problem in base.problems:
        console.print(f"DOES NOT FIT ({selected}): {problem}")
    return console.export_text()


def main(argv: list[str] | None = None) -> int:
    args, as_json = _parse(list(sys.argv[1:] if argv is None else argv))
    config = resolve_sglang_config(args)
    plan = build_plan(args, config)
    memory = memory_plans(args)
    if as_json:
        mem = None if memory is None else {"selected": next(iter(memory)), "policies": {p: m.to_dict() for p, m in memory.items()}}  # fmt: skip
        ranks = train_ranks(args)
        print(json.dumps({"source": config.source, **plan.to_dict(), "train_ranks": ranks, "memory": mem}, indent=2))
    else:
        sys.stdout.write(render_table(plan, config.source))
        if not args.debug_rollout_only:
            sys.stdout.write(render_ranks(train_ranks(args)))
        if memory is None:
            sys.stdout.write("memory plan: needs the model's shape (config.json at --hf-checkpoint)\n")
        else:
            sys.stdout.write(render_memory(memory))
    return 0 if memory is None or next(iter(memory.values())).feasible else 1
