"""Flags of the inference side that are slime's own: which servers run, topology, external engines, health.

The `--sglang-*` server flags and `--router-*` router flags are generated from snapshots (`flags.py`).
"""

from __future__ import annotations

import argparse

from slime.backends.sglang import server_plugins
from slime.utils.errors import SlimeArgError


def add_rollout_engine_arguments(p: argparse.ArgumentParser, argv: list[str] | None = None) -> None:
    """slime's inference flags, and those of every server plugin (`server_plugins.py`): registered ones, and one
    named by import path in `argv`'s --rollout-engine."""
    g = p.add_argument_group("inference servers")
    names = ", ".join(server_plugins.registered()) or "none installed"
    g.add_argument(
        "--rollout-engine",
        default="auto",
        help="sglang: real SGLang servers (--sglang-python); a server plugin's name (registered: "
        f"{names}) or import path (package.module:Class); auto: SGLang where CUDA is, else the plugin that stands in "
        "for it without CUDA",
    )
    for plugin in server_plugins.all_plugins(argv):
        plugin.add_arguments(p)
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
    chosen = server_plugins.plugin(args.rollout_engine)  # an unknown engine is one line here
    plugins = list(server_plugins.registered().values())
    for plugin in [*plugins, *([chosen] if chosen is not None and chosen not in plugins else [])]:
        plugin.validate(args)  # its own flags, e.g. files they name
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
