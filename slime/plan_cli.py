"""`slime plan --sglang-config X [--json] <slime train flags>`: print the deployment plan, start nothing.

Takes the same flags as `slime train` so what it prints is what training would launch. Planning must work
on a laptop without the checkpoint, so `--hf-checkpoint` need not exist and the batch-size flags that
`train` requires get neutral defaults here.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tempfile

from slime.backends.sglang.deployment import DeploymentPlan, build_plan
from slime.backends.sglang.sglang_config import resolve_sglang_config


def _parse(argv: list[str]) -> tuple[argparse.Namespace, bool]:
    from slime.arguments import build_parser, reject_unknown, validate_args

    parser = build_parser()
    parser.prog = "slime plan"
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    args, unknown = parser.parse_known_args(argv)
    reject_unknown(parser, unknown)
    as_json = args.json
    del args.json
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


def main(argv: list[str] | None = None) -> int:
    args, as_json = _parse(list(sys.argv[1:] if argv is None else argv))
    config = resolve_sglang_config(args)
    plan = build_plan(args, config)
    if as_json:
        print(json.dumps({"source": config.source, **plan.to_dict()}, indent=2))
    else:
        sys.stdout.write(render_table(plan, config.source))
    return 0
