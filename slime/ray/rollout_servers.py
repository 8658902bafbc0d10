"""Launch the deployment plan under Ray: one router per model, every engine group, worker registration, and
engine fault tolerance (health monitor, removal, restart before the next weight sync).

Lives in the RolloutManager's process. Engines are Ray actors (0.2 GPU on their first bundle; one actor per
node for an engine spanning nodes) that own their server process; routers are child processes of the manager
and bind the manager's node address. With `--rollout-external` nothing is launched: the router fronts the
given servers. Rollout code only sees router URLs: `args.sglang_model_routers = {model: url}` and model 0's
router in `args.sglang_router_ip/port`.
"""

from __future__ import annotations

import copy
import logging
import os
import threading
from argparse import Namespace
from dataclasses import dataclass, field
from typing import Any

import ray

from slime.backends.sglang import server_plugins
from slime.backends.sglang.client import SGLangClient
from slime.backends.sglang.deployment import DeploymentPlan, EnginePlan, build_plan
from slime.backends.sglang.engine import SGLangEngine
from slime.backends.sglang.router import RouterProcess
from slime.backends.sglang.sglang_config import SGLangConfig, resolve_sglang_config
from slime.utils.http_utils import find_free_port, node_address
from slime.utils.process import start_with_free_port

logger = logging.getLogger(__name__)

ENGINE_GPU = 0.2
ENGINE_CPU = 0.01
_REMOTE_ENGINE: Any = None


@dataclass
class EngineSlot:
    plan: EnginePlan
    handle: Any = None  # node rank 0's actor: the engine
    followers: list[Any] = field(default_factory=list)  # node ranks 1.. of an engine spanning nodes
    url: str | None = None
    pid: int | None = None
    bootstrap_port: int | None = None
    alive: bool = False
    restarts: int = 0
    # held while an engine is torn down or restarted, so recover() never races mark_dead() on one slot
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def actors(self) -> list[Any]:
        return [h for h in (self.handle, *self.followers) if h is not None]


@dataclass
class ExternalEngine:
    """A server slime did not launch (`--rollout-external`): controlled over HTTP, never restarted."""

    url: str
    model: str
    rank: int
    alive: bool = True


def _engine_args(args: Namespace, blocks: dict[str, dict[str, Any]]) -> Namespace:
    """The args an engine actor sees: the model's block for the server plugin that serves the run, if any, sets that
    plugin's flags for this model's engines (`ModelConfig.plugin_blocks`)."""
    block = blocks.get(args.rollout_engine)
    if not block:
        return args
    plugin = server_plugins.plugin(args.rollout_engine)
    a = copy.copy(args)
    for key, value in block.items():
        setattr(a, plugin.model_keys[key], value)
    return a


class RolloutServers:
    def __init__(self, args: Namespace, placement: Any, log_dir: str, config: SGLangConfig | None = None) -> None:
        self.args = args
        self.placement = placement
        self.log_dir = log_dir
        self.config = config or resolve_sglang_config(args)
        self.plan: DeploymentPlan = build_plan(args, self.config, host=node_address())
        self.routers: dict[str, RouterProcess | None] = {}
        self.router_urls: dict[str, str] = {}
        self.slots = [EngineSlot(e) for e in self.plan.engines]
        model = self.config.models[0].name
        addrs = args.rollout_external_engine_addrs if args.rollout_external else []
        self.external = [
            ExternalEngine(a if a.startswith("http") else f"http://{a}", model, i) for i, a in enumerate(addrs)
        ]
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._monitor_paused = threading.Event()
        self._monitor: threading.Thread | None = None
        self.removed_urls: list[str] = []
        self._starting: list[list[Any]] = []  # engine start refs between `launch` and `finish_start`

    # ---- start-up -----------------------------------------------------------------------------------------
    def start(self) -> None:
        self.launch()
        self.finish_start()

    def launch(self) -> None:
        """Create and start every engine without waiting for it (`finish_start` waits): the caller can do its
        own start-up work while the engines load their weights."""
        os.makedirs(self.log_dir, exist_ok=True)
        for slot in self.slots:
            self._create(slot)
        self._starting = self._launch(self.slots)

    def finish_start(self) -> None:
        """Routers up (while the engines load), engines registered with them, the health monitor started."""
        args = self.args
        starting, self._starting = self._starting, []
        for rp in self.plan.routers:
            if rp.reuse_user_router:
                self.routers[rp.model] = None
                self.router_urls[rp.model] = f"http://{rp.host}:{rp.port}"
                continue
            log = os.path.join(self.log_dir, f"router_{rp.model}.log")
            router = start_with_free_port(
                lambda rp=rp, log=log: RouterProcess.start(
                    args, host=rp.host, port=find_free_port(host=rp.host), pd=rp.pd, log_file=log
                ),
                f"router {rp.model}",
            )
            self.routers[rp.model] = router
            self.router_urls[rp.model] = router.url
        self._register(self.slots, starting)
        for ext in self.external:
            if not SGLangClient(ext.url).healthy("/health", timeout=30.0):
                raise RuntimeError(f"--rollout-external-engine-addrs: {ext.url} does not answer /health")
            router = self.routers[ext.model]
            if router is not None:
                router.add_worker(ext.url)
        first = self.router_urls[self.plan.routers[0].model]
        host, port = first.removeprefix("http://").rsplit(":", 1)
        args.sglang_router_ip, args.sglang_router_port = host, int(port)
        args.sglang_model_routers = dict(self.router_urls)
        logger.info("rollout servers up: %s", {m: len(self.plan.engines_of(m)) for m in self.router_urls})
        if args.use_fault_tolerance:
            self._monitor = threading.Thread(target=self._monitor_loop, name="engine-health", daemon=True)
            self._monitor.start()

    def _create(self, slot: EngineSlot) -> None:
        """One actor per node the engine spans, each on the bundle of its node's first GPU."""
        global _REMOTE_ENGINE
        e = slot.plan
        cls = _REMOTE_ENGINE = _REMOTE_ENGINE or ray.remote(SGLangEngine)
        per_node = -(-e.num_gpus // e.nnodes)
        actors = []
        for k in range(e.nnodes):
            first = e.base_gpu_id + k * per_node
            actors.append(
                cls.options(
                    num_gpus=ENGINE_GPU, num_cpus=ENGINE_CPU, scheduling_strategy=self.placement.strategy(first)
                ).remote(
                    _engine_args(self.args, self.config.model(e.model).plugin_blocks),
                    e.rank,
                    base_gpu_id=self.placement.gpu_ids[first],
                    num_gpus=e.num_gpus,
                    worker_type=e.worker_type,
                    overrides=e.overrides or None,
                    model_path=e.model_path,
                    log_dir=self.log_dir,
                    nnodes=e.nnodes,
                    node_rank=k,
                )  # fmt: skip
            )
        slot.handle, slot.followers = actors[0], actors[1:]

    def _launch(self, slots: list[EngineSlot]) -> list[list[Any]]:
        """Start every engine (all nodes of one engine at once: node 0 is healthy only when the others joined);
        returns without waiting."""
        refs = []
        for s in slots:
            addr = ray.get(s.handle.dist_init_address.remote()) if s.followers else None
            refs.append([a.start.remote(addr) for a in s.actors])
        return refs

    def _finish_start(self, slots: list[EngineSlot]) -> None:
        self._register(slots, self._launch(slots))

    def _register(self, slots: list[EngineSlot], refs: list[list[Any]]) -> None:
        """Wait for the engines `_launch` started, then register each with its model's router."""
        try:
            urls = [ray.get(r)[0] for r in refs]
        except Exception as e:
            tails = [ray.get(a.log_tail.remote()) for s in slots for a in s.followers if not ray.get(a.alive.remote())]
            raise RuntimeError(f"engine start-up failed: {e}" + "".join(tails)) from e
        meta = ray.get([s.handle.get_bootstrap_port.remote() for s in slots])
        pids = ray.get([s.handle.pid.remote() for s in slots])
        for s, url, boot, pid in zip(slots, urls, meta, pids, strict=True):
            s.url, s.bootstrap_port, s.pid, s.alive = url, boot, pid, True
            router = self.routers[s.plan.model]
            if router is not None:
                router.add_worker(url, worker_type=s.plan.worker_type, bootstrap_port=boot)

    # ---- queries ------------------------------------------------------------------------------------------
    def weight_sync_engines(self) -> list[dict[str, Any]]:
        """`{"url", "num_gpus", "base_gpu"}` of every live engine of the model that receives weights (the first
        with update_weights): `num_gpus` gives it that many ranks of a broadcast group, `base_gpu` (logical)
        tells colocated train ranks which of them share its GPUs."""
        model = self.config.weight_sync_model
        if model is None:
            return []
        with self._lock:
            out = [
                {"url": s.url, "num_gpus": s.plan.num_gpus, "base_gpu": s.plan.base_gpu_id}
                for s in self.slots
                if s.alive and s.plan.model == model.name
            ]
            out += [{"url": x.url, "num_gpus": 1, "base_gpu": None} for x in self.external if x.alive]
        return out

    def engine_handles(self, model: str | None = None) -> list[Any]:
        with self._lock:
            return [s.handle for s in self.slots if s.alive and (model is None or s.plan.model == model)]

    def info(self) -> dict[str, Any]:
        with self._lock:
            first = self.plan.routers[0].model
            r0 = self.routers.get(first)
            engines = [
                {"model": s.plan.model, "rank": s.plan.rank, "worker_type": s.plan.worker_type, "url": s.url,
                 "pid": s.pid, "alive": s.alive, "restarts": s.restarts, "nnodes": s.plan.nnodes}
                for s in self.slots
            ]  # fmt: skip
            engines += [
                {"model": x.model, "rank": x.rank, "worker_type": "external", "url": x.url, "pid": None,
                 "alive": x.alive, "restarts": 0, "nnodes": 1}
                for x in self.external
            ]  # fmt: skip
            return {
                "router_pid": r0.pid if r0 is not None else None,
                "router_url": self.router_urls.get(first),
                "engine_pids": [s.pid for s in self.slots],
                "engine_urls": [e["url"] for e in engines],
                "routers": {
                    m: {
                        "pid": r.pid if r is not None else None,
                        "url": self.router_urls[m],
                        "pd": self.plan.router_of(m).pd,
                    }
                    for m, r in self.routers.items()
                },
                "engines": engines,
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
        if self._stop.wait(args.rollout_health_check_first_wait):
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
                for ext in [x for x in self.external if x.alive]:
                    if not SGLangClient(ext.url).healthy(timeout=timeout) and not self._monitor_paused.is_set():
                        self._remove_from_router(ext.model, ext.url, f"external engine {ext.url}: health check failed")
                        ext.alive = False
            self._stop.wait(interval)

    def _remove_from_router(self, model: str, url: str, reason: str) -> None:
        self.removed_urls.append(url)
        logger.warning("%s", reason)
        router = self.routers.get(model)
        if router is not None:
            try:
                router.remove_worker(url)
            except Exception:  # noqa: BLE001 - the router may already have dropped it
                logger.warning("removing %s from its router failed", url, exc_info=True)

    def mark_dead(self, slot: EngineSlot, reason: str) -> None:
        """Take an engine out: off its router first (no new requests), then kill its server so in-flight
        requests fail now and the client retries them from scratch on the other engines."""
        with self._lock:
            if not slot.alive:
                return
            slot.alive = False
        with slot.lock:
            self._remove_from_router(
                slot.plan.model,
                slot.url or "",
                f"engine {slot.plan.rank} ({slot.plan.model}, {slot.url}) is dead: {reason}",
            )
            for actor in slot.actors:
                try:
                    ray.get(actor.kill_server.remote(), timeout=15)
                except Exception:  # noqa: BLE001 - the actor itself may be gone
                    pass
                ray.kill(actor, no_restart=True)
            slot.handle, slot.followers = None, []

    def recover(self) -> int:
        """Restart and re-register dead engines (called before each weight sync); returns how many came back."""
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
        # every engine stops at once (each waits out its own grace period), then its actor goes
        stopping = [(s, actor, actor.shutdown.remote()) for s in self.slots for actor in s.actors]
        for s, actor, ref in stopping:
            try:
                ray.get(ref, timeout=30)
            except Exception:  # noqa: BLE001 - best effort: the engine may already be gone
                logger.warning("engine %d shutdown failed", s.plan.rank, exc_info=True)
            ray.kill(actor, no_restart=True)
        for s in self.slots:
            s.handle, s.followers, s.alive = None, [], False
        for router in self.routers.values():
            if router is not None:
                router.stop()
        self.routers = {}
