"""Bring up `torch.distributed` and megatron-core's parallel state for one training rank.

The train actor calls, in order:

    init_distributed(args, rank, world_size, master_addr, master_port)   # gloo on CPU, NCCL on GPU
    ps = init_megatron(args)        # --custom-megatron-init-path hook, model-parallel groups, seeds
    ... build_gpt_model(args) / load_hf_weights(model, args.hf_checkpoint, spec, ps) ...

Why the hook runs first: megatron-core assumes CUDA. On a CPU-only host the CPU shim must patch it before
the RNG tracker is seeded or any model is built, and it enters only through slime's hook flag
(`--custom-megatron-init-path package.module.function`): slime names no shim itself. Without CUDA and without a
hook we stop with a one-line hint, naming the shims installed ones register (`slime.cpu_shims` entry points),
instead of megatron's CUDA assertion.

args read: tensor_model_parallel_size, pipeline_model_parallel_size, virtual_pipeline_model_parallel_size,
context_parallel_size, expert_model_parallel_size, expert_tensor_parallel_size, distributed_backend,
distributed_timeout_minutes, seed, custom_megatron_init_path.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import random
import socket
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from slime.backends.megatron.parallel_state import MegatronParallelState
from slime.utils.distributed import bind_gloo_to, client_store, master_store
from slime.utils.errors import SlimeArgError
from slime.utils.misc import load_function
from slime.utils.plugins import entry_points

logger = logging.getLogger(__name__)

CPU_SHIM_GROUP = "slime.cpu_shims"  # entry points of megatron-core CPU shims ("package.module:function")


def cpu_shim_hooks() -> list[str]:
    """Import paths of the registered CPU shims, as `--custom-megatron-init-path` takes them."""
    return sorted(target.replace(":", ".") for target in entry_points(CPU_SHIM_GROUP).values())


def _check_device(args: Any) -> None:
    if not torch.cuda.is_available() and not args.custom_megatron_init_path:
        shims = cpu_shim_hooks()
        how = f"pass --custom-megatron-init-path {' or '.join(shims)}" if shims else "no CPU shim is installed"
        raise SlimeArgError(f"no CUDA device: to run megatron-core on CPU {how}")


def run_custom_megatron_init(args: Any) -> None:
    """Call the `--custom-megatron-init-path` hook with `args` (idempotent hooks may be called repeatedly)."""
    _check_device(args)
    path = args.custom_megatron_init_path
    if path:
        load_function(path)(args)


def init_distributed(
    args: Any,
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    local_rank: int | None = None,
    *,
    node_ip: str | None = None,
    listen: socket.socket | None = None,
) -> None:
    """`dist.init_process_group` for this rank (no-op if already initialised).

    Rank 0 serves the rendezvous store on `listen` (a socket it bound on its node's address, see
    `slime/utils/distributed.py`) or else binds `master_addr:master_port`; every gloo group of this process
    listens on `node_ip` (default: `master_addr` for rank 0, loopback otherwise)."""
    _check_device(args)
    if dist.is_initialized():
        return
    backend = args.distributed_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(local_rank if local_rank is not None else rank % torch.cuda.device_count())
    os.environ["MASTER_ADDR"] = master_addr
    os.environ["MASTER_PORT"] = str(master_port)
    timeout = datetime.timedelta(minutes=args.distributed_timeout_minutes)
    bind_gloo_to(node_ip or (master_addr if rank == 0 else "127.0.0.1"))
    if rank == 0:
        store = master_store(listen or _bound(master_addr, master_port), world_size, timeout)
    else:
        store = client_store(master_addr, master_port, world_size, timeout)
    options = _one_rank_nccl_options() if backend == "nccl" and world_size == 1 else None
    dist.init_process_group(
        backend=backend, store=store, rank=rank, world_size=world_size, timeout=timeout, pg_options=options
    )
    logger.info("torch.distributed up: rank %d/%d, backend %s", rank, world_size, backend)


def _one_rank_nccl_options() -> Any:
    """NCCL options for a communicator of one rank: one CTA. It moves no data, but NCCL sizes its buffers by
    CTAs (channels): on an H200 such a communicator holds 389 MiB with the default 32 and 11 MiB with one, and a
    trainer creates one per megatron group it runs a collective on — most of what a sleeping trainer holds."""
    options = dist.ProcessGroupNCCL.Options()
    options.config.max_ctas = options.config.min_ctas = 1
    return options


@contextlib.contextmanager
def _lean_one_rank_groups() -> Iterator[None]:
    """While megatron creates its groups: every NCCL group of one rank gets `_one_rank_nccl_options` (megatron's
    own per-group options are keyed by group name, not size, and its groups of one rank are the common case:
    every parallel dimension of size 1)."""
    new_group = dist.new_group

    def lean_new_group(ranks: Any = None, *args: Any, **kwargs: Any) -> Any:
        backend = kwargs.get("backend")
        if ranks is not None and len(ranks) == 1 and kwargs.get("pg_options") is None and backend in (None, "nccl"):
            if dist.get_backend() == "nccl":
                kwargs["pg_options"] = _one_rank_nccl_options()
        return new_group(ranks, *args, **kwargs)

    dist.new_group = lean_new_group
    try:
        yield
    finally:
        dist.new_group = new_group


def _bound(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    return sock


def set_seeds(seed: int) -> None:
    """Megatron's seeding: Python, NumPy and torch get `seed + 100 * pp_rank`; TP ranks fork a tracked stream."""
    import numpy as np
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel

    seed = seed + 100 * mpu.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def init_megatron(args: Any) -> MegatronParallelState:
    """Run the init hook, create megatron's model-parallel groups, seed, and return the `ParallelState`."""
    from megatron.core import parallel_state as mpu

    if not dist.is_initialized():
        raise RuntimeError("init_megatron needs torch.distributed: call init_distributed first")
    run_custom_megatron_init(args)
    if not mpu.model_parallel_is_initialized():
        with _lean_one_rank_groups():
            mpu.initialize_model_parallel(
                tensor_model_parallel_size=args.tensor_model_parallel_size,
                pipeline_model_parallel_size=args.pipeline_model_parallel_size,
                virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
                context_parallel_size=args.context_parallel_size,
                expert_model_parallel_size=args.expert_model_parallel_size,
                expert_tensor_parallel_size=args.expert_tensor_parallel_size,
                distributed_timeout_minutes=args.distributed_timeout_minutes,
            )
    set_seeds(args.seed)
    ps = MegatronParallelState()
    logger.info("megatron parallel state: %r", ps)
    return ps


def destroy_megatron() -> None:
    """Tear down megatron's groups and the default process group (tests, actor shutdown)."""
    from megatron.core import parallel_state as mpu

    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
