"""Inference servers other than SGLang that speak its HTTP protocol, entering slime as plugins.

slime starts real SGLang itself (`server_args.py`). Anything else that answers SGLang's endpoints — a simulator
on a laptop, a user's own engine — plugs in here, and slime's code knows nothing more of it than this protocol:

- it is registered under the entry-point group ``slime.rollout_engines`` (``name = "package.module:Class"`` in its
  distribution's metadata), or named by import path: ``--rollout-engine package.module:Class``;
- `add_arguments(parser)` registers its own flags into slime's one flat namespace (only it reads them);
- `validate(args)` refuses bad input with a one-line `SlimeArgError` before Ray starts;
- `model_keys` ({YAML key: flag dest}): what a `--sglang-config` model may set for its own engines in a block
  named after the plugin (``<name>: {key: value}``), applied as those flags for that model's engines; a key that
  names a file is resolved against the YAML's directory when the plugin lists it in `path_keys`;
- `server_argv(args, spec)` is the command line of one server, given the same placement facts SGLang's gets;
- `stands_in_without_cuda`: `--rollout-engine auto` picks this plugin on a machine without CUDA (one at most).

CPU shims for megatron-core register the same way (group ``slime.cpu_shims``; `backends/megatron/initialize.py`).
"""

from __future__ import annotations

import argparse
import functools
import sys
from dataclasses import dataclass
from typing import Any, Protocol

from slime.utils.errors import SlimeArgError
from slime.utils.plugins import entry_points, load

ENGINE_GROUP = "slime.rollout_engines"


@dataclass(frozen=True)
class ServerSpec:
    """Where and as what one server runs (the facts SGLang's own argv is built from)."""

    host: str
    port: int
    rank: int
    model_path: str
    num_gpus: int = 1
    worker_type: str = "regular"
    bootstrap_port: int | None = None
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    base_gpu_id: int = 0


class ServerPlugin(Protocol):
    name: str
    stands_in_without_cuda: bool
    model_keys: dict[str, str]
    path_keys: frozenset[str]

    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def validate(self, args: argparse.Namespace) -> None: ...

    def check_model_block(self, block: dict[str, Any]) -> str | None:
        """Why a model's block is refused (None: accepted)."""

    def server_argv(self, args: argparse.Namespace, spec: ServerSpec) -> list[str]: ...


def _load(target: str) -> ServerPlugin:
    try:
        obj = load(target)
    except (ImportError, AttributeError) as e:
        raise SlimeArgError(f"--rollout-engine {target}: cannot load it ({e})") from e
    return obj() if isinstance(obj, type) else obj


@functools.cache
def registered() -> dict[str, ServerPlugin]:
    """Every plugin of the ``slime.rollout_engines`` group, by name."""
    return {name: _load(target) for name, target in sorted(entry_points(ENGINE_GROUP).items())}


def named_in_argv(argv: list[str] | None) -> str | None:
    """The `--rollout-engine` value of a command line, read before parsing (an import-path plugin's own flags must
    be registered before the parser sees them)."""
    argv = sys.argv[1:] if argv is None else argv
    for i, token in enumerate(argv):
        if token == "--rollout-engine" and i + 1 < len(argv):
            return argv[i + 1]
        if token.startswith("--rollout-engine="):
            return token.split("=", 1)[1]
    return None


def plugin(name: str) -> ServerPlugin | None:
    """The plugin `--rollout-engine NAME` names (None for sglang and auto); an unknown name is one line."""
    if name in ("sglang", "auto"):
        return None
    if name in registered():
        return registered()[name]
    if "." in name or ":" in name:
        return _import_path_plugin(name)
    known = ", ".join(["sglang", "auto", *registered()])
    raise SlimeArgError(f"--rollout-engine {name}: not a registered engine plugin ({known}) nor an import path")


@functools.cache
def _import_path_plugin(target: str) -> ServerPlugin:
    return _load(target)


def all_plugins(argv: list[str] | None = None) -> list[ServerPlugin]:
    """The registered plugins, plus one named by import path on this command line."""
    out = list(registered().values())
    name = named_in_argv(argv)
    if name and name not in registered() and ("." in name or ":" in name):
        out.append(_import_path_plugin(name))
    return out


def stand_in() -> ServerPlugin | None:
    """The plugin `--rollout-engine auto` takes on a machine without CUDA."""
    found = [p for p in registered().values() if p.stands_in_without_cuda]
    return found[0] if len(found) == 1 else None
