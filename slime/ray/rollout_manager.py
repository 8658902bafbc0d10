"""`RolloutManager`: owns the data source, the rollout/eval functions, the engines and the router.

It turns each rollout's samples into per-DP-rank train data (`train_data.py`) and hands the trainer one
object ref per rank. In `--debug-train-only` / `--load-debug-rollout-data` it starts no engine and no
router: rollouts are read from the dump instead.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import random
import sys
import time
from argparse import Namespace
from collections.abc import Callable
from typing import Any, TypeVar

import ray

from slime.ray.actor_faults import ServerDied
from slime.ray.placement import Placement
from slime.ray.train_data import build_rank_data, rollout_samples
from slime.rollout.base_types import call_rollout_fn
from slime.rollout.data_source import call_with_checkpoint_dir
from slime.scheduling.carry import CarryBuffer
from slime.scheduling.fully_async import filter_stale_groups
from slime.scheduling.staleness import staleness_metrics
from slime.utils import faults
from slime.utils.atomic import atomic_open
from slime.utils.console import configure_actor
from slime.utils.gc_policy import relax_gc_for_rollouts
from slime.utils.misc import load_function
from slime.utils.types import Sample

logger = logging.getLogger(__name__)

ENGINE_GPU = 0.2
F = TypeVar("F", bound=Callable[..., Any])


def _running(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.NoSuchProcess:
        return False


def servers_checked(method: F) -> F:
    """A call that needs the servers: when it fails because a router or engine process is gone, it raises
    `ServerDied` (a fault `--max-restarts` restarts after, slime/ray/actor_faults.py), not the error that caused."""

    @functools.wraps(method)
    def checked(self: RolloutManager, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except Exception as e:
            dead = self._dead_server()
            if dead is not None:
                raise ServerDied(*dead) from e
            raise

    return checked  # type: ignore[return-value]


def dump_path(template: str, rollout_id: int) -> str:
    return template.format(rollout_id=rollout_id)


def _save_pt(obj: Any, path: str) -> None:
    import torch  # here: the driver imports this module too and never needs torch

    with atomic_open(path, "wb") as f:
        torch.save(obj, f)


def _load_pt(path: str) -> Any:
    import torch

    return torch.load(path, weights_only=False)


class RolloutManager:
    def __init__(self, args: Namespace, placement: Placement | None) -> None:
        self.log_path = configure_actor(args.log_level, args.metrics_dir, "rollout_manager")
        relax_gc_for_rollouts()  # tens of thousands of live samples: the default thresholds cost superlinearly
        self.args = args
        self.placement = placement
        self.carry = CarryBuffer()
        self.parallel_config: dict[str, int] = {"dp_size": 1, "cp_size": 1}
        self.servers = None
        self.data_source = None
        # rollouts generated but not yet turned into train data: {rollout id: (samples, metrics, seconds)}
        self._pending: dict[int, tuple[list[Sample], dict[str, float], float]] = {}
        self.fully_async = None
        if not args.debug_train_only:
            self._start_servers(then=self._load_rollout_code)  # engines load while the data source does
        else:
            self._load_rollout_code()
        if args.fully_async:
            from slime.rollout.fully_async import FullyAsyncRollout

            self.fully_async = FullyAsyncRollout(args, self.data_source)

    # ---- servers ---------------------------------------------------------------------------------------------
    def _load_rollout_code(self) -> None:
        if not self.args.load_debug_rollout_data:
            self.data_source = load_function(self.args.data_source_path)(self.args)
        self.rollout_fn = load_function(self.args.rollout_function_path)
        self.eval_fn = load_function(self.args.eval_function_path)

    def _start_servers(self, then: Callable[[], None]) -> None:
        """Every model's router and engine groups, from the deployment plan (slime/ray/rollout_servers.py);
        `then()` runs while the engines load their weights."""
        from slime.ray.rollout_servers import RolloutServers

        self.servers = RolloutServers(self.args, self.placement, os.path.join(self.args.metrics_dir, "servers"))
        try:
            self.servers.launch()
            then()
            self.servers.finish_start()
        except BaseException:
            self.servers.dispose()
            raise

    def server_info(self) -> dict[str, Any]:
        """Pids and URLs of what this manager started (tests check identity and clean-up with psutil)."""
        info: dict[str, Any] = {"router_pid": None, "router_url": None, "engine_pids": [], "engine_urls": []}
        if self.servers is not None:
            info.update(self.servers.info())
        info["manager_pid"] = os.getpid()
        torch = sys.modules.get("torch")  # not imported: then no process group can exist either
        info["dist_initialized"] = bool(
            torch and torch.distributed.is_available() and torch.distributed.is_initialized()
        )
        return info

    # ---- weight sync ----------------------------------------------------------------------------------------
    @servers_checked
    def lock_weight_sync_engines(self) -> list[dict[str, Any]]:
        """The engines a weight sync must reach, held for it: dead engines are restarted first, and the health
        monitor pauses until `unlock_weight_sync_engines` (paused engines look dead). Each is `{"url",
        "num_gpus", "base_gpu"}`: the model with `update_weights` first in --sglang-config receives weights."""
        if self.fully_async is not None:
            self.fully_async.pause()  # no request may reach an engine while it loads (docs/async.md)
        if self.servers is None:
            return []
        self.servers.recover()
        self.servers.pause_health_monitor()
        faults.inject("rollout_manager", "weight_sync")  # engines held for a sync that never comes
        return self.servers.weight_sync_engines()

    def unlock_weight_sync_engines(self, version: int | None = None) -> None:
        """After a weight sync to `version` (None: it failed or changed nothing); fully-async generation resumes."""
        if self.servers is not None:
            self.servers.resume_health_monitor()
        if self.fully_async is not None:
            self.fully_async.resume(version)

    # ---- colocated offload (order: docs/architecture.md#colocated-offload) ----------------------------------
    def _offloaded_engines(self) -> list[Any]:
        return self.servers.engine_handles() if self.servers is not None else []

    @servers_checked
    def offload(self) -> None:
        """Free the engines' GPU memory for training: flush, then release every tag (weights, KV, graphs)."""
        engines = self._offloaded_engines()
        if engines:
            servers = self.servers
            servers.pause_health_monitor()  # released engines cannot answer /health_generate
            ray.get([e.release_memory_occupation.remote() for e in engines])

    @servers_checked
    def onload(self, tags: list[str] | None = None) -> None:
        """Re-occupy engine memory: `["weights"]` before the weight sync, then `["kv_cache", "cuda_graph"]`."""
        engines = self._offloaded_engines()
        if engines:
            ray.get([e.resume_memory_occupation.remote(tags) for e in engines])
            if tags is None or "kv_cache" in tags:
                self.servers.resume_health_monitor()

    # ---- rollouts --------------------------------------------------------------------------------------------
    def num_rollout_per_epoch(self) -> int:
        return len(self.data_source) // self.args.rollout_batch_size if self.data_source is not None else 0

    def set_train_parallel_config(self, config: dict[str, int]) -> None:
        self.parallel_config = dict(config)

    def _load_dump(self, rollout_id: int) -> list[Sample]:
        path = dump_path(self.args.load_debug_rollout_data, rollout_id)
        data = _load_pt(path)
        samples = [Sample.from_dict(d) for d in data["samples"]]
        frac = self.args.load_debug_rollout_data_subsample
        if frac is not None:
            rng = random.Random(rollout_id)
            keep = {s.group_id for s in samples if rng.random() < frac}
            samples = [s for s in samples if s.group_id in keep]
        return samples

    @servers_checked
    def rollout(self, rollout_id: int) -> None:
        """Generate rollout `rollout_id` and keep its samples until `train_data` (the one-step-ahead loop converts
        rollout k, whose carry-over comes first, before it launches rollout k+1). A rollout restored from a
        checkpoint (generated but not yet trained when it was saved) is used as is."""
        if rollout_id in self._pending:
            return
        t0 = time.perf_counter()
        extra: dict[str, float] = {}
        if self.args.load_debug_rollout_data:
            samples = self._load_dump(rollout_id)
        else:
            if faults.enabled():
                self._signal_faults()
            out = call_rollout_fn(self.rollout_fn, self.args, rollout_id, self.data_source, evaluation=False)
            faults.inject("rollout_manager", "rollout")  # generated, not yet kept: the groups exist nowhere else
            extra.update(out.metrics or {})
            # --max-weight-staleness outside --fully-async: groups --partial-rollout recycled may carry old tokens
            groups, _, stale = filter_stale_groups(
                out.samples,
                rollout_id,
                self.args.max_weight_staleness,
                self.args.async_unused_samples_handler,
                self.data_source,
            )
            extra.update(stale)
            extra.update(staleness_metrics(groups, rollout_id))
            samples = rollout_samples(groups)
        self._pending[rollout_id] = (samples, extra, time.perf_counter() - t0)

    def _dead_server(self, grace: float = 3.0) -> tuple[str, str] | None:
        """(name, what happened) of the first router or engine process that is gone, else None. Waits up to `grace`
        seconds: a server stopping on SIGTERM refuses requests before its process ends."""
        if self.servers is None:
            return None
        info = self.servers.info()
        procs = [("router", info["router_pid"]), *((f"engine_{i}", p) for i, p in enumerate(info["engine_pids"]))]
        deadline = time.monotonic() + grace
        while True:
            for name, pid in procs:
                if pid is not None and not _running(pid):
                    return name, f"its process {pid} exited"
            if time.monotonic() > deadline:
                return None
            time.sleep(0.1)

    def _signal_faults(self) -> None:
        """SLIME_FAULT for the processes that run no slime code, as signals at a rollout's start: the router and
        engine 0 (slime/utils/faults.py)."""
        if self.servers is not None:
            info = self.servers.info()
            faults.signal_fault("router", "rollout", info["router_pid"])
            faults.signal_fault("engine", "rollout", (info["engine_pids"] or [None])[0])

    def train_data(self, rollout_id: int) -> tuple[list[Any] | None, dict[str, float] | None]:
        """The kept rollout as train data: (one object ref per DP rank, or None under --debug-rollout-only; the
        rollout's metrics for the driver to log, or None when --custom-rollout-log-function-path logged them)."""
        samples, extra, rollout_time = self._pending.pop(rollout_id)
        return self._to_train_data(rollout_id, samples, extra, rollout_time)

    # ---- fully async (slime/rollout/fully_async.py) ------------------------------------------------------------
    def start_producer(self, rollout_id: int) -> None:
        """Start generating for a trainer at weight version `rollout_id` (the engines just received it)."""
        self.fully_async.start(rollout_id, engine_version=rollout_id)

    def consume(self, rollout_id: int) -> tuple[list[Any] | None, dict[str, float] | None]:
        """The next `--rollout-batch-size` finished groups within the staleness bound, as train data."""
        t0 = time.perf_counter()
        groups, metrics = self.fully_async.consume(rollout_id)
        faults.inject("rollout_manager", "rollout")
        if path := self.args.rollout_sample_filter_path:
            load_function(path)(self.args, groups)
        return self._to_train_data(rollout_id, rollout_samples(groups), metrics, time.perf_counter() - t0)

    def stop_producer(self) -> None:
        if self.fully_async is not None:
            self.fully_async.stop()

    def _to_train_data(
        self, rollout_id: int, samples: list[Sample], extra: dict[str, float], rollout_time: float
    ) -> tuple[list[Any] | None, dict[str, float] | None]:
        if self.args.save_debug_rollout_data and not self.args.load_debug_rollout_data:
            dump = {"rollout_id": rollout_id, "hf_checkpoint": self.args.hf_checkpoint}
            _save_pt(
                {**dump, "samples": [s.to_dict() for s in samples]},
                dump_path(self.args.save_debug_rollout_data, rollout_id),
            )
        metrics = {**extra, **self._rollout_metrics(samples)}
        rank_refs = None
        if not self.args.debug_rollout_only:
            rank_data, sched_metrics = build_rank_data(
                self.args, rollout_id, samples, self.carry, self.parallel_config
            )
            metrics.update(sched_metrics)
            rank_refs = [ray.put(d) for d in rank_data]
        hook = self.args.custom_rollout_log_function_path
        # slime's hook: True means it logged the rollout itself and the default logging is skipped
        if hook and load_function(hook)(rollout_id, self.args, samples, extra, rollout_time):
            return rank_refs, None
        return rank_refs, metrics

    def _rollout_metrics(self, samples: list[Sample]) -> dict[str, float]:
        if not samples:
            return {"rollout/num_samples": 0.0}
        n = len(samples)
        return {
            "rollout/num_samples": float(n),
            "rollout/raw_reward_mean": sum(s.get_reward_value(self.args) for s in samples) / n,
            "rollout/response_len_mean": sum(s.response_length for s in samples) / n,
        }

    @servers_checked
    def eval(self, rollout_id: int) -> dict[str, float] | None:
        """The eval's metrics for the driver to log (None when --custom-eval-rollout-log-function-path did)."""
        if self.args.eval_prompt_data is None or self.args.debug_train_only:
            return {}

        def evaluate() -> Any:
            return call_rollout_fn(self.eval_fn, self.args, rollout_id, self.data_source, evaluation=True)

        if self.fully_async is not None:  # beside the producer and the trainer: collected by `finished_evals`
            self.fully_async.start_eval(rollout_id, evaluate)
            return {}
        return self._eval_metrics(rollout_id, evaluate())

    def finished_evals(self, wait: bool = False) -> list[tuple[int, dict[str, float] | None]]:
        """Fully async: (rollout id, metrics or None as `eval` returns them) of each background eval done since
        the last call; `wait`: every one started (the run's end)."""
        if self.fully_async is None:
            return []
        return [
            (rid, self._eval_metrics(rid, out, {"eval/weight_version": float(-1 if version is None else version)}))
            for rid, version, out in self.fully_async.finished_evals(wait)
        ]

    def _eval_metrics(self, rollout_id: int, out: Any, own: dict[str, float] | None = None) -> dict[str, float] | None:
        extra = {**(out.metrics or {}), **(own or {})}
        metrics = dict(extra)
        for name, d in out.data.items():
            rewards = d["rewards"]
            metrics[f"eval/{name}"] = sum(rewards) / max(len(rewards), 1)
        hook = self.args.custom_eval_rollout_log_function_path
        if hook and load_function(hook)(rollout_id, self.args, out.data, extra):
            return None
        return metrics

    # ---- checkpoint: this manager's part lives in <checkpoint dir>/rollout/ ---------------------------------
    def save(self, rollout_id: int, path: str) -> None:
        """Data-source state (position, counters, buffer) and the carried-over groups, atomically per file."""
        rollout_dir = os.path.join(path, "rollout")
        os.makedirs(rollout_dir, exist_ok=True)
        if self.fully_async is not None:
            self.fully_async.save(rollout_id, rollout_dir)  # with the data source, in one step of its loop
        elif self.data_source is not None:
            call_with_checkpoint_dir(self.data_source.save, rollout_id, rollout_dir)
        faults.inject("rollout_manager", "save")  # the data source's part written, the carry-over not
        with atomic_open(os.path.join(rollout_dir, f"carry_{rollout_id}.json")) as f:
            json.dump(self.carry.state_dict(), f)
        if self._pending:  # the one-step-ahead loop saves rollout k while rollout k+1, generated, waits to train
            pending = {
                rid: ([s.to_dict() for s in samples], extra) for rid, (samples, extra, _) in self._pending.items()
            }
            _save_pt(pending, os.path.join(rollout_dir, f"pending_{rollout_id}.pt"))

    def load(self, rollout_id: int, path: str) -> None:
        rollout_dir = os.path.join(path, "rollout")
        if self.data_source is not None:
            call_with_checkpoint_dir(self.data_source.load, rollout_id, rollout_dir)
        carry_path = os.path.join(rollout_dir, f"carry_{rollout_id}.json")
        if os.path.exists(carry_path):
            with open(carry_path, encoding="utf-8") as f:
                self.carry.load_state_dict(json.load(f))
            logger.info("resumed %d carried-over groups from %s", len(self.carry), carry_path)
        pending_path = os.path.join(rollout_dir, f"pending_{rollout_id}.pt")
        if os.path.exists(pending_path):
            pending = _load_pt(pending_path)
            for rid, (samples, extra) in pending.items():
                self._pending[int(rid)] = ([Sample.from_dict(d) for d in samples], extra, 0.0)
            if pending:
                logger.info("resumed generated, untrained rollout(s) %s from %s", sorted(pending), pending_path)
        if self.fully_async is not None:
            self.fully_async.load(rollout_id, rollout_dir)

    def dispose(self) -> None:
        if self.fully_async is not None:
            try:
                self.fully_async.stop()
            except Exception:  # noqa: BLE001 - the producer's failure was reported where it happened
                logger.warning("stopping the fully-async producer failed", exc_info=True)
            self.fully_async = None
        if self.servers is not None:
            self.servers.dispose()
            self.servers = None
