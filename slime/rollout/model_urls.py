"""Where rollout code reaches a model of `--sglang-config`: its router's URL."""

from __future__ import annotations

from typing import Any


def get_model_url(args: Any, name: str | None = None, endpoint: str = "/generate") -> str:
    """The router URL of model `name` (from `--sglang-config`), or of the actor model when `name` is None."""
    if name is None:
        return f"http://{args.sglang_router_ip}:{args.sglang_router_port}{endpoint}"
    routers: dict[str, str] = args.sglang_model_routers or {}
    if name not in routers:
        raise KeyError(
            f"no router for model {name!r}; known models: {sorted(routers) or 'none'} (see --sglang-config)"
        )
    return routers[name].rstrip("/") + endpoint
