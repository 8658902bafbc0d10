"""Launch the deployment plan under Ray: one router per model, every engine group, worker registration, and
engine fault tolerance (health monitor, removal, restart before the next weight sync).

Lives in the RolloutManager's process. Engines are Ray actors (0.2 GPU on their first bundle) that own one
server process each; routers are child processes of the manager. Rollout code only sees router URLs:
`args.sglang_model_routers = {model: url}` and model 0's router in `args.sglang_router_ip/port` (spec §2.2).
"""

from __future__ import annotations

import copy
import logging
import os
import signal
import subprocess
import threading
import time
from argparse import Namespace
from dataclasses import dataclass, field
from typing import Any

import httpx
import ray

from slime.backends.sglang.deployment import DeploymentPlan, EnginePlan, build_plan
from slime.backends.sglang.engine import SGLangEngine, _die_with_parent, _tail, resolve_backend
from slime.backends.sglang.router import RouterProcess
from slime.backends.sglang.server_args import build_server_argv
from slime.backends.sglang.sglang_config import SGLangConfig, resolve_sglang_config
from slime.utils.http_utils import find_free_port

logger = logging.getLogger(__name__)

ENGINE_GPU = 0.2
ENGINE_CPU = 0.01
_REMOTE_ENGINE: Any = None


class TopologyEngine(SGLangEngine):
    """SGLangEngine that also knows its PD role: a prefill gets a bootstrap port, and a fake engine is told its
    disaggregation mode (the fake's argv builder in server_args.py only covers regular engines)."""

    def __init__(self, args: Namespace, rank: int, **kwargs: Any) -> None:
        super().__init__(args, rank, **kwargs)
        self.bootstrap_port: int | None = None

    def start(self, timeout: float = 600.0) -> str:
        self.port = find_free_port()
        self.bootstrap_port = find_free_port() if self.worker_type == "prefill" else None
        backend = resolve_backend(self.args)
        argv = build_server_argv(
            self.args, backend=backend, host=self.host, port=self.port, base_gpu_id=self.base_gpu_id,
            num_gpus=self.num_gpus, rank=self.rank, nccl_port=find_free_port(), worker_type=self.worker_type,
            bootstrap_port=self.bootstrap_port, overrides=self.overrides, model_path=self.model_path,
        )  # fmt: skip
        if backend == "sim" and self.worker_type in ("prefill", "decode"):
            argv += ["--disaggregation-mode", self.worker_type]
            if self.bootstrap_port is not None:
                argv += ["--disaggregation-bootstrap-port", str(self.bootstrap_port)]
        log_path = os.path.join(self.log_dir, f"engine_{self.rank}.log") if self.log_dir else None
        out = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115 - the child's for life
        logger.info("engine %d (%s): %s", self.rank, self.worker_type, " ".join(argv))
        self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"engine {self.rank} exited with {self.proc.returncode} at start-up{_tail(log_path)}"
                )
            try:
                if httpx.get(f"{self.url}/health_generate", timeout=30).status_code == 200:
                    return self.url
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.shutdown()
        raise TimeoutError(f"engine {self.rank} not healthy within {timeout:.0f}s{_tail(log_path)}")

    def get_bootstrap_port(self) -> int | None:
        return self.bootstrap_port

    def kill_server(self) -> None:
        """SIGKILL the server's process group: in-flight requests fail at once (and are retried elsewhere)
        instead of coming back as aborted partial answers, which a graceful stop would produce."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=10)


@dataclass
class EngineSlot:
    plan: EnginePlan
    handle: Any = None
    url: str | None = None
    pid: int | None = None
    bootstrap_port: int | None = None
    alive: bool = False
    restarts: int = 0
    # held while an engine is torn down or restarted, so recover() never races mark_dead() on one slot
    lock: threading.Lock = field(default_factory=threading.Lock)


def _engine_args(args: Namespace, sim: dict[str, Any]) -> Namespace:
    """The args an engine actor sees: the model's `sim:` block picks its fake engine (--rollout-engine sim)."""
    if not sim:
        return args
    a = copy.copy(args)
    a.sim_engine = sim.get("engine", args.sim_engine)
    a.sim_script = sim.get("script", args.sim_script)
    a.sim_synthetic_config = sim.get("synthetic_config", args.sim_synthetic_config)
    return a


class RolloutServers:
    def __init__(self, args: Namespace, placement: Any, log_dir: str, config: SGLangConfig | None = None) -> None:
        self.args = args
        self.placement = placement
        self.log_dir = log_dir
        self.config = config or resolve_sglang_config(args)
        self.plan: DeploymentPlan = build_plan(args, self.config)
        self.routers: dict[str, RouterProcess | None] = {}
        self.router_urls: dict[str, str] = {}
        self.slots = [EngineSlot(e) for e in self.plan.engines]
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._monitor_paused = threading.Event()
        self._monitor: threading.Thread | None = None
        self.removed_urls: list[str] = []

    # ---- start-up -----------------------------------------------------------------------------------------
    def start(self) -> None:
        args = self.args
        os.makedirs(self.log_dir, exist_ok=True)
        for rp in self.plan.routers:
            if rp.reuse_user_router:
                self.routers[rp.model] = None
                self.router_urls[rp.model] = f"http://{rp.host}:{rp.port}"
                continue
            log = os.path.join(self.log_dir, f"router_{rp.model}.log")
            router = RouterProcess.start(args, host=rp.host, port=find_free_port(host=rp.host), pd=rp.pd, log_file=log)
            self.routers[rp.model] = router
            self.router_urls[rp.model] = router.url
        for slot in self.slots:
            self._create(slot)
        self._finish_start(self.slots)
        first = self.router_urls[self.plan.routers[0].model]
        host, port = first.removeprefix("http://").rsplit(":", 1)
        args.sglang_router_ip, args.sglang_router_port = host, int(port)
        args.sglang_model_routers = dict(self.router_urls)
        logger.info("rollout servers up: %s", {m: len(self.plan.engines_of(m)) for m in self.router_urls})
        if getattr(args, "use_fault_tolerance", False):
            self._monitor = threading.Thread(target=self._monitor_loop, name="engine-health", daemon=True)
            self._monitor.start()

    def _create(self, slot: EngineSlot) -> None:
        global _REMOTE_ENGINE
        e = slot.plan
        cls = _REMOTE_ENGINE = _REMOTE_ENGINE or ray.remote(TopologyEngine)
        gpu_ids = self.placement.gpu_ids
        slot.handle = cls.options(
            num_gpus=ENGINE_GPU, num_cpus=ENGINE_CPU, scheduling_strategy=self.placement.strategy(e.base_gpu_id)
        ).remote(
            _engine_args(self.args, self.config.model(e.model).sim), e.rank, base_gpu_id=gpu_ids[e.base_gpu_id],
            num_gpus=e.num_gpus, worker_type=e.worker_type, overrides=e.overrides or None, model_path=e.model_path,
            log_dir=self.log_dir,
        )  # fmt: skip

    def _finish_start(self, slots: list[EngineSlot]) -> None:
        urls = ray.get([s.handle.start.remote() for s in slots])
        meta = ray.get([s.handle.get_bootstrap_port.remote() for s in slots])
        pids = ray.get([s.handle.pid.remote() for s in slots])
        for s, url, boot, pid in zip(slots, urls, meta, pids, strict=True):
            s.url, s.bootstrap_port, s.pid, s.alive = url, boot, pid, True
            router = self.routers[s.plan.model]
            if router is not None:
                router.add_worker(url, worker_type=s.plan.worker_type, bootstrap_port=boot)

    # ---- queries ------------------------------------------------------------------------------------------
    def updatable_engines(self) -> list[Any]:
        """Handles of the engines that receive weight sync: the FIRST model with update_weights (spec §1.5).
        Dead engines are None (same positions as the plan), as slime does until `recover()` refills them."""
        model = self.config.weight_sync_model
        if model is None:
            return []
        with self._lock:
            return [s.handle if s.alive else None for s in self.slots if s.plan.model == model.name]

    def engine_handles(self, model: str | None = None) -> list[Any]:
        with self._lock:
            return [s.handle for s in self.slots if s.alive and (model is None or s.plan.model == model)]

    def info(self) -> dict[str, Any]:
        with self._lock:
            first = self.plan.routers[0].model
            r0 = self.routers.get(first)
            return {
                "router_pid": r0.pid if r0 is not None else None,
                "router_url": self.router_urls.get(first),
                "engine_pids": [s.pid for s in self.slots],
                "engine_urls": [s.url for s in self.slots],
                "routers": {
                    m: {
                        "pid": r.pid if r is not None else None,
                        "url": self.router_urls[m],
                        "pd": self.plan.router_of(m).pd,
                    }
                    for m, r in self.routers.items()
                },
                "engines": [
                    {
                        "model": s.plan.model,
                        "rank": s.plan.rank,
                        "worker_type": s.plan.worker_type,
                        "url": s.url,
                        "pid": s.pid,
                        "alive": s.alive,
                        "restarts": s.restarts,
                    }
                    for s in self.slots
                ],  # fmt: skip
                "removed_urls": list(self.removed_urls),
            }

    # ---- fault tolerance ----------------------------------------------------------------------------------
    def pause_health_monitor(self) -> None:
        """Engines paused for a weight update or offloaded do not answer /health_generate: stop judging them."""
        self._monitor_paused.set()

    def resume_health_monitor(self) -> None:
        self._monitor_paused.clear()

    def _monitor_loop(self) -> None:
        args = self.args
        interval = float(args.rollout_health_check_interval)
        timeout = float(args.rollout_health_check_timeout)
        if self._stop.wait(float(getattr(args, "rollout_health_check_first_wait", 0.0) or 0.0)):
            return
        while not self._stop.is_set():
            if not self._monitor_paused.is_set():
                with self._lock:
                    live = [s for s in self.slots if s.alive]
                refs = {s.handle.health_generate.remote(): (s, s.handle) for s in live}
                ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout + 1.0) if refs else ([], [])
                for ref, (slot, checked) in refs.items():
                    ok = False
                    if ref in ready:
                        try:
                            ok = bool(ray.get(ref))
                        except Exception:  # noqa: BLE001 - a dead actor is a failed check
                            ok = False
                    stale = slot.handle is not checked  # restarted meanwhile: this verdict is about the old one
                    if not ok and not stale and not self._stop.is_set() and not self._monitor_paused.is_set():
                        self.mark_dead(slot, "health check failed" if ref in ready else "health check timed out")
            self._stop.wait(interval)

    def mark_dead(self, slot: EngineSlot, reason: str) -> None:
        """Take an engine out: off its router first (no new requests), then kill its server so in-flight
        requests fail now and the client retries them from scratch on the other engines."""
        with self._lock:
            if not slot.alive:
                return
            slot.alive = False
        with slot.lock:
            self._tear_down(slot, reason)

    def _tear_down(self, slot: EngineSlot, reason: str) -> None:
        handle = slot.handle
        self.removed_urls.append(slot.url or "")
        logger.warning("engine %d (%s, %s) is dead: %s", slot.plan.rank, slot.plan.model, slot.url, reason)
        router = self.routers.get(slot.plan.model)
        if router is not None and slot.url:
            try:
                router.remove_worker(slot.url)
            except Exception:  # noqa: BLE001 - the router may already have dropped it
                logger.warning("removing %s from its router failed", slot.url, exc_info=True)
        try:
            ray.get(handle.kill_server.remote(), timeout=15)
        except Exception:  # noqa: BLE001 - the actor itself may be gone
            pass
        ray.kill(handle, no_restart=True)
        slot.handle = None

    def recover(self) -> int:
        """Restart and re-register dead engines (the lead calls this before each weight sync); returns how many
        came back, so weight-update groups can be rebuilt when it is > 0."""
        with self._lock:
            dead = [s for s in self.slots if not s.alive]
        if not dead:
            return 0
        for s in dead:
            s.lock.acquire()  # waits for a teardown still in progress
        try:
            for s in dead:
                s.restarts += 1
                self._create(s)
            self._finish_start(dead)
        finally:
            for s in dead:
                s.lock.release()
        logger.info("recovered %d engine(s): %s", len(dead), [s.url for s in dead])
        return len(dead)

    # ---- shutdown -----------------------------------------------------------------------------------------
    def dispose(self) -> None:
        self._stop.set()
        if self._monitor is not None:
            self._monitor.join(timeout=float(self.args.rollout_health_check_timeout) + 5)
        for s in self.slots:
            if s.handle is None:
                continue
            try:
                ray.get(s.handle.shutdown.remote(), timeout=30)
            except Exception:  # noqa: BLE001 - best effort: the engine may already be gone
                logger.warning("engine %d shutdown failed", s.plan.rank, exc_info=True)
            ray.kill(s.handle, no_restart=True)
            s.handle, s.alive = None, False
        for router in self.routers.values():
            if router is not None:
                router.stop()
        self.routers = {}
