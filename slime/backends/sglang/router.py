"""The real `sglang-router` 0.3.2 (SGLang Model Gateway): its argv and a handle on its process.

slime launches one router per model and registers every engine through the router's HTTP API
(`POST /workers`, `DELETE /workers/{id}`, `GET /workers`; the legacy `/add_worker` is gone in 0.3.2).
Settings slime forces, and why (docs/router.md):
- `--disable-health-check`: engines pause generation and release GPU memory during weight updates and
  colocated offload; the router's prober would evict them then. slime's own health monitor handles faults.
- `--request-timeout-secs` from `--sglang-router-request-timeout-secs` (14400): rollouts stream for hours.
- Prometheus: 0.3.2 always starts an exporter (default 0.0.0.0:29000, so two routers would clash and the
  port would face the network). slime binds it to the router's host on a free port unless the user says.
- `--router-policy consistent_hashing` (slime's name for header affinity) runs 0.3.2's `manual` policy,
  which pins each `X-SMG-Routing-Key` to one worker (docs/router.md has the evidence).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from typing import Any

import httpx

from slime.backends.sglang.flags import (
    ROUTER_POLICY_ALIASES,
    render_option,
    router_options_by_dest,
    router_overrides_from_args,
)
from slime.utils.http_utils import find_free_port
from slime.utils.process import ManagedProcess, log_tail

logger = logging.getLogger(__name__)


def build_router_argv(
    args: argparse.Namespace, *, host: str, port: int, pd: bool = False, prometheus_port: int | None = None
) -> list[str]:
    """`python -m sglang_router.launch_router ...` with slime's settings, then every `--router-*` the user set."""
    opts = router_options_by_dest()
    user = router_overrides_from_args(args)
    for dest in ("policy", "prefill_policy", "decode_policy"):
        if dest in user:
            user[dest] = ROUTER_POLICY_ALIASES.get(user[dest], user[dest])
    settings: dict[str, Any] = {
        "request_timeout_secs": args.sglang_router_request_timeout_secs,
        "disable_health_check": True,
        "prometheus_host": host,
    }
    if pd:
        settings.update(pd_disaggregation=True, disable_circuit_breaker=True)
    settings.update(user)
    if settings.get("prometheus_port") is None:
        settings["prometheus_port"] = prometheus_port or find_free_port(host=settings["prometheus_host"])
    argv = [sys.executable, "-m", "sglang_router.launch_router", "--host", host, "--port", str(port)]
    for dest, value in settings.items():
        argv += render_option(opts[dest], value)
    return argv


class RouterProcess:
    """One running sglang-router; `start` returns when its `/health` answers."""

    def __init__(self, process: ManagedProcess, host: str, port: int, log_file: str) -> None:
        self.process = process
        self.host = host
        self.port = port
        self.log_file = log_file
        self._client = httpx.Client(base_url=self.url, timeout=30.0)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    @classmethod
    def start(
        cls,
        args: argparse.Namespace,
        host: str,
        port: int,
        pd: bool = False,
        log_file: str | None = None,
        timeout: float = 120.0,
    ) -> RouterProcess:
        if log_file is None:
            fd, log_file = tempfile.mkstemp(prefix=f"slime-router-{port}-", suffix=".log")
            os.close(fd)
        argv = build_router_argv(args, host=host, port=port, pd=pd)
        process = ManagedProcess.start(argv, name=f"sglang-router {host}:{port}", log_path=log_file)
        router = cls(process, host, port, log_file)
        try:
            process.wait_healthy(f"{router.url}/health", timeout, request_timeout=2.0, port=port)
        except BaseException:
            router._client.close()
            raise
        return router

    def list_workers(self) -> list[dict[str, Any]]:
        """`GET /workers`: [{"id", "url", "worker_type", "is_healthy", ...}] (sglang-router 0.3.2 shape)."""
        r = self._client.get("/workers")
        r.raise_for_status()
        return r.json().get("workers", [])

    def _find(self, url: str) -> dict[str, Any] | None:
        url = url.rstrip("/")
        return next((w for w in self.list_workers() if w.get("url", "").rstrip("/") == url), None)

    def add_worker(
        self, url: str, worker_type: str = "regular", bootstrap_port: int | None = None, timeout: float = 60.0
    ) -> str:
        """Register an engine and wait until the router lists it healthy; returns the router's worker id.

        Registration is asynchronous in 0.3.2 (202, then a background job probes the worker), hence the wait.
        """
        body: dict[str, Any] = {"url": url, "worker_type": worker_type}
        if bootstrap_port is not None:
            body["bootstrap_port"] = bootstrap_port
        r = self._client.post("/workers", json=body)
        if r.status_code not in (200, 201, 202):
            raise RuntimeError(f"router refused worker {url}: HTTP {r.status_code} {r.text[:200]}")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            w = self._find(url)
            if w is not None and w.get("is_healthy", False):
                return str(w["id"])
            time.sleep(0.2)
        raise TimeoutError(
            f"worker {url} not listed healthy by {self.url} after {timeout:.0f}s{log_tail(self.log_file)}"
        )

    def remove_worker(self, url: str, timeout: float = 30.0) -> bool:
        """Deregister an engine (`DELETE /workers/{id}`) and wait until it is gone; False if it was not listed."""
        w = self._find(url)
        if w is None:
            return False
        r = self._client.delete(f"/workers/{w['id']}")
        if r.status_code not in (200, 202, 204):
            raise RuntimeError(f"router refused to remove {url}: HTTP {r.status_code} {r.text[:200]}")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._find(url) is None:
                return True
            time.sleep(0.1)
        raise TimeoutError(f"worker {url} still listed by {self.url} after {timeout:.0f}s")

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM the router's process group, SIGKILL after `grace` seconds (it drains in-flight requests)."""
        self._client.close()
        self.process.stop(grace)
