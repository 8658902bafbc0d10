"""Flags of the inference side that are slime's own: which servers run, topology, external engines, health.

The `--sglang-*` server flags and `--router-*` router flags are generated from snapshots (`flags.py`).
"""

from __future__ import annotations

import argparse
import os

from slime.utils.errors import SlimeArgError


def add_rollout_engine_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("inference servers")
    g.add_argument(
        "--rollout-engine",
        choices=["sglang", "sim", "auto"],
        default="auto",
        help="sglang: real SGLang servers; sim: sim.fake_sglang servers; auto: sglang when installed with CUDA",
    )
    g.add_argument("--sim-engine", choices=["hf", "scripted", "synthetic"], default="hf", help="fake engine kind")
    g.add_argument("--sim-script", default=None, help="rules file for --sim-engine scripted")
    g.add_argument("--sim-synthetic-config", default=None, help="distribution file for --sim-engine synthetic")
    g.add_argument("--sim-request-log-dir", default=None, help="fake engines write request logs here")
    g.add_argument("--sglang-config", default=None, help="YAML topology of models, server groups and routers")
    g.add_argument("--prefill-num-servers", type=int, default=None, help="PD split without a YAML: prefill engines")
    g.add_argument(
        "--rollout-external",
        action="store_true",
        help="attach to already-running SGLang servers (--rollout-external-engine-addrs): nothing is launched "
        "but the router in front of them",
    )
    g.add_argument("--rollout-external-engine-addrs", nargs="+", default=None, help="HOST:PORT of each server")
    g.add_argument("--use-fault-tolerance", action="store_true", help="health-check engines, restart dead ones")
    g.add_argument("--rollout-health-check-interval", type=float, default=30.0)
    g.add_argument("--rollout-health-check-timeout", type=float, default=30.0)
    g.add_argument("--rollout-health-check-first-wait", type=float, default=0.0)


def validate_rollout_engine_args(args: argparse.Namespace) -> None:
    for name in ("sim_script", "sim_synthetic_config"):
        path = getattr(args, name)
        if path is not None and not os.path.isfile(path):
            raise SlimeArgError(f"--{name.replace('_', '-')}: file not found: {path}")
    if args.rollout_engine == "sim" and args.sim_engine == "scripted" and args.sim_script is None:
        raise SlimeArgError("--sim-engine scripted needs --sim-script FILE (rules)")
    if args.rollout_external:
        if not args.rollout_external_engine_addrs:
            raise SlimeArgError("--rollout-external needs --rollout-external-engine-addrs HOST:PORT [HOST:PORT ...]")
        for addr in args.rollout_external_engine_addrs:
            host, sep, port = addr.removeprefix("http://").rpartition(":")
            if not sep or not host or not port.isdigit():
                raise SlimeArgError(f"--rollout-external-engine-addrs: {addr!r} is not HOST:PORT")
        for flag in ("sglang_config", "prefill_num_servers"):
            if getattr(args, flag) is not None:
                raise SlimeArgError(f"--rollout-external excludes --{flag.replace('_', '-')} (nothing is launched)")
        if args.colocate:
            raise SlimeArgError("--rollout-external excludes --colocate (external servers have their own GPUs)")
    elif args.rollout_external_engine_addrs:
        raise SlimeArgError("--rollout-external-engine-addrs is only read with --rollout-external")
