"""The argv of one inference server: real SGLang (`python -m sglang.launch_server`) or a server plugin's.

Why argv and not an in-process `ServerArgs`: SGLang is not importable where slime runs on CPU, and a
command line is what the engine actor spawns anyway. Values are merged per ServerArgs dest with rising
priority — slime's per-engine settings (`_slime_settings`), the user's `--sglang-*` flags, then the `--sglang-config`
group's `overrides` — and each dest is rendered once, in the form SGLang's parser expects (the snapshot's
action kind says how: bare flag, `--x/--no-x`, one value, or nargs values).
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from slime.backends.sglang import server_plugins
from slime.backends.sglang.flags import (
    render_option,
    sglang_options_by_dest,
    sglang_overrides_from_args,
    snapshot_version_for,
)
from slime.backends.sglang.server_plugins import ServerSpec
from slime.utils.errors import SlimeArgError

logger = logging.getLogger(__name__)

WORKER_TYPES = ("regular", "prefill", "decode", "encoder")


def _slime_settings(
    args: argparse.Namespace,
    *,
    host: str,
    port: int,
    base_gpu_id: int,
    num_gpus: int,
    rank: int,
    nccl_port: int | None,
    dist_init_addr: str | None,
    worker_type: str,
    bootstrap_port: int | None,
    pp_size: int,
    model_path: str | None,
    nnodes: int,
    node_rank: int,
) -> dict[str, Any]:
    if num_gpus % pp_size:
        raise SlimeArgError(f"--sglang-pp-size {pp_size} does not divide the engine's {num_gpus} GPUs")
    s: dict[str, Any] = {
        "model_path": model_path or args.hf_checkpoint,
        "trust_remote_code": True,
        "random_seed": args.seed + rank,
        "enable_memory_saver": bool(args.offload_rollout),
        "host": host,
        "port": port,
        "nccl_port": nccl_port,
        "dist_init_addr": dist_init_addr,
        "nnodes": nnodes,
        "node_rank": node_rank,
        "base_gpu_id": base_gpu_id,
        "gpu_id_step": 1,
        "tp_size": num_gpus // pp_size,
        "skip_server_warmup": True,
        # the weights in the dtype the trainer syncs (a float32 checkpoint config would give SGLang's `auto` float16,
        # and every bf16 update would be rounded again on load); --sglang-dtype overrides
        "dtype": "bfloat16" if args.bf16 else None,
    }
    if worker_type == "prefill":
        s.update(disaggregation_mode="prefill", load_balance_method="follow_bootstrap_room")
        s["disaggregation_bootstrap_port"] = bootstrap_port
    elif worker_type == "decode":
        s["disaggregation_mode"] = "decode"
    elif worker_type == "encoder":
        s["encoder_only"] = True
    return {k: v for k, v in s.items() if v is not None}


def build_server_argv(
    args: argparse.Namespace,
    *,
    backend: str,
    host: str,
    port: int,
    base_gpu_id: int = 0,
    num_gpus: int = 1,
    rank: int = 0,
    nccl_port: int | None = None,
    dist_init_addr: str | None = None,
    worker_type: str = "regular",
    bootstrap_port: int | None = None,
    overrides: dict[str, Any] | None = None,
    model_path: str | None = None,
    nnodes: int = 1,
    node_rank: int = 0,
) -> list[str]:
    """The command line of engine `rank` (of its node `node_rank` when it spans `nnodes` nodes); `overrides`
    (a --sglang-config group's) win over everything."""
    if nnodes > 1 and not dist_init_addr:
        raise ValueError("an engine spanning several nodes needs dist_init_addr (node rank 0's address)")
    if backend != "sglang":  # a server plugin (server_plugins.py) builds its own
        plugin = server_plugins.plugin(backend)
        if plugin is None:
            raise ValueError(f"backend {backend!r} is neither sglang nor a server plugin")
        spec = ServerSpec(
            host=host, port=port, rank=rank, model_path=str(model_path or args.hf_checkpoint), num_gpus=num_gpus,
            worker_type=worker_type, bootstrap_port=bootstrap_port, nnodes=nnodes, node_rank=node_rank,
            dist_init_addr=dist_init_addr, base_gpu_id=base_gpu_id,
        )  # fmt: skip
        return plugin.server_argv(args, spec)
    if worker_type not in WORKER_TYPES:
        raise SlimeArgError(f"worker_type {worker_type!r} does not start an engine; expected one of {WORKER_TYPES}")
    if worker_type == "prefill" and bootstrap_port is None:
        raise SlimeArgError("a prefill engine needs a bootstrap_port")
    # rendered as the release the servers run spells them (preflight learnt it), else in the newest spelling
    opts = sglang_options_by_dest(snapshot_version_for(args.sglang_version) if args.sglang_version else None)
    normalized = {str(k).replace("-", "_"): v for k, v in (overrides or {}).items()}
    user = sglang_overrides_from_args(args)
    pp_size = int(normalized.get("pp_size") or user.get("pp_size") or 1)
    merged = _slime_settings(
        args,
        host=host,
        port=port,
        base_gpu_id=base_gpu_id,
        num_gpus=num_gpus,
        rank=rank,
        nccl_port=nccl_port,
        dist_init_addr=dist_init_addr,
        worker_type=worker_type,
        bootstrap_port=bootstrap_port,
        pp_size=pp_size,
        model_path=normalized.pop("model_path", None) or model_path,
        nnodes=nnodes,
        node_rank=node_rank,
    )
    merged.update(user)
    for key, value in normalized.items():
        if key not in opts:
            # Validated up front (validate_override_keys); a newer SGLang may still lack an older field.
            logger.warning("dropping override %r: not a ServerArgs flag of this SGLang snapshot", key)
            continue
        merged[key] = value
    argv = [args.sglang_python or sys.executable, "-m", "sglang.launch_server"]
    for dest, value in merged.items():
        if value is not None:
            argv += render_option(opts[dest], value)
    return argv
