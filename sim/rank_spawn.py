"""`torch.multiprocessing.spawn` for the tests' CPU/gloo ranks, without paying the imports in every rank.

Why: a spawned rank starts a fresh interpreter and imports torch, megatron-core, transformers and slime's trainer
before its first line of work, ~7-9 CPU-seconds; the CPU suite spawns about forty such ranks, each on a machine
of two cores. Python's own fork server (`multiprocessing`'s "forkserver" start method) imports a list of modules
once per test worker and then forks every rank from that process, so a rank starts with them already imported.
A rank is otherwise exactly what `spawn` gives: a new process that unpickles its function and arguments, with the
parent's `sys.path` and working directory, joined the same way and failing the same way (`ProcessRaisedException`
naming the rank).

What a rank does NOT inherit is the test worker's current environment: the fork server's environment is the one
it started with (the first `spawn_ranks` of the worker). Tests that need a variable in a rank set it there.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from typing import Any

# What the ranks of the CPU suite import before their work. An import that fails here is skipped by the fork
# server, and the rank then imports it (or fails on it) itself, as a spawned rank would.
PRELOAD = [
    "torch",
    "torch.distributed",
    "transformers",
    "transformers.models.qwen2.modeling_qwen2",
    "slime.backends.megatron",  # installs the lean import of megatron-core (lean_import.py) before it loads
    "megatron.core",
    "slime.backends.megatron.trainer",
    "slime.arguments",
]


def spawn_ranks(fn: Callable[..., Any], args: tuple = (), nprocs: int = 1, daemon: bool = False) -> None:
    """Run `fn(rank, *args)` in `nprocs` processes forked from the worker's fork server and wait for all of them.

    `daemon`: the ranks die with the test process should it be interrupted (as in `torch.multiprocessing.spawn`).
    """
    import torch.multiprocessing as mp

    multiprocessing.set_forkserver_preload(PRELOAD)  # read once, when the worker's first call starts the server
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, daemon=daemon, start_method="forkserver")
