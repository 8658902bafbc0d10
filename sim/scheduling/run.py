"""One simulated training run: slime's loop driver, rollout functions, fully-async producer, buffer and staleness
filter, against simulated engines and a simulated trainer, on a virtual clock.

What is real and what is simulated:

| real (imported from `slime/`) | simulated |
|---|---|
| `run_loop` (the order of a step in each mode), `LoopPlan` | engines: `sim/scheduling/engines.py` |
| sync / partial rollout: `generate_rollout_async` (over-sampling, abort, recycling) | the `/generate` call |
| fully async: `AsyncRollout` (producer, admission, buffer, filter, pause/resume) | trainer: a sleep per step |
| the data source with its buffer, `generate_and_rm` (semaphore, masks, reward) | weight sync: a sleep |
| the staleness rule, the sync/one-step stale filter, the flags' validation | |

Modes: `sync`, `one_step`, `fully_async` (`--fully-async`, with `max_staleness` k; `in_flight`: with
`--update-weights-in-flight`, each sync pauses the engines in place instead of aborting), and `partial` (the sync loop
with `--partial-rollout` and over-sampling: each rollout starts `over_sampling` × the batch and keeps the first
that finish; the rest go back to the buffer with their tokens).
"""

from __future__ import annotations

import asyncio
import json
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from sim.scheduling.clock import run_virtual
from sim.scheduling.engines import CURRENT, EnginePool
from sim.scheduling.slot_pool import SlotPool
from sim.workloads.long_tail import DEFAULT, Workload
from slime.arguments import check_schedule_combinations, default_args
from slime.rollout.data_source import RolloutDataSourceWithBuffer
from slime.rollout.fully_async import SGLangGroupGenerator, async_config, buffer_capacity
from slime.rollout.generate import GenerateState
from slime.rollout.sglang_rollout import generate_rollout_async
from slime.scheduling.arguments import validate_async_args
from slime.scheduling.fully_async import AsyncRollout, filter_stale_groups
from slime.scheduling.group_buffer import GroupBuffer, group_from_json, group_to_json
from slime.scheduling.loop import LoopBackend, LoopPlan, run_loop
from slime.scheduling.staleness import flatten, group_staleness, parse_version
from slime.utils.misc import load_function

SIM_MODES = ("sync", "one_step", "fully_async", "partial")


@dataclass(frozen=True)
class SimConfig:
    mode: str
    max_staleness: int | None = None
    unused_handler: str = "retry"
    update_weights_interval: int = 1
    buffer_capacity_factor: float = 2.0
    max_concurrent_samples: int | None = None  # None: every engine slot (engines × slots per engine)
    over_sampling: float = 2.0  # partial mode: groups started per rollout, as a multiple of the batch
    mask_offpolicy: bool = False
    horizon_s: float = 3600.0
    max_steps: int | None = None  # stop after this many steps instead (then the run ends cleanly)
    custom_buffer_path: str | None = None
    save_interval: int | None = None  # keep a checkpoint (what the RolloutManager saves) every N steps
    kill_at_s: float | None = None  # the run dies at this simulated time, wherever it is
    in_flight: bool = False  # --update-weights-in-flight (fully async only)
    engine_model: str = "batched"  # or "slots": independent slots, O(1) per request (sim/scheduling/slot_pool.py)

    def __post_init__(self) -> None:
        if self.mode not in SIM_MODES:
            raise ValueError(f"mode must be one of {SIM_MODES}, got {self.mode!r}")

    @property
    def label(self) -> str:
        if self.mode == "fully_async":
            k = "inf" if self.max_staleness is None else self.max_staleness
            label = f"fully_async k={k}" + (f" ({self.unused_handler})" if self.max_staleness is not None else "")
            return label + (", in flight" if self.in_flight else "")
        return self.mode + (f" ({self.unused_handler})" if self.mode == "partial" and self.max_staleness else "")


class _Horizon(Exception):
    """The simulated time is up (raised out of the loop after a whole step)."""


def sim_args(w: Workload, c: SimConfig) -> Any:
    """slime flags for the simulated job, validated by slime's own async rules."""
    batch = w.rollout_batch_size
    args = default_args(
        rollout_batch_size=batch,
        n_samples_per_prompt=w.n_samples_per_prompt,
        rollout_max_response_len=w.max_new_tokens,
        custom_generate_function_path="sim.scheduling.engines.generate",
        custom_rm_path="sim.scheduling.engines.reward",
        disable_rollout_global_dataset=True,
        rollout_num_gpus=w.engines,
        sglang_server_concurrency=w.slots_per_engine,
        num_rollout=c.max_steps or 10**9,
        update_weights_interval=c.update_weights_interval,
        one_step_ahead=c.mode == "one_step",
        fully_async=c.mode == "fully_async",
        partial_rollout=c.mode == "partial",
        over_sampling_batch_size=max(batch, math.ceil(c.over_sampling * batch)) if c.mode == "partial" else batch,
        mask_offpolicy_in_partial_rollout=c.mask_offpolicy,
        max_weight_staleness=c.max_staleness,
        async_unused_samples_handler=c.unused_handler,
    )
    if c.mode == "fully_async":
        args.async_max_concurrent_samples = c.max_concurrent_samples or w.engines * w.slots_per_engine
        args.async_data_buffer_capacity_factor = c.buffer_capacity_factor
        args.custom_async_data_buffer_path = c.custom_buffer_path
        args.update_weights_in_flight = c.in_flight
    validate_async_args(args)
    check_schedule_combinations(args)
    return args


class SimGroupGenerator(SGLangGroupGenerator):
    """slime's fully-async generator; only the engines' abort is the simulated pool's."""

    def __init__(self, args: Any, pool: EnginePool) -> None:
        super().__init__(args)
        self.pool = pool

    async def abort_all(self) -> None:
        GenerateState.get(self.args).aborted = True
        await self.pool.abort_all()


@dataclass
class Consumed:
    rollout_id: int
    prompt_index: int
    staleness: int
    samples: int
    tokens: int  # response tokens
    span_versions: list[list[int]]  # per sample, the weight version of each answer (or part of one) in order
    trained_tokens: int = 0  # response tokens with loss mask 1
    trained_versions: list[int] = field(default_factory=list)  # the versions of the trained spans


@dataclass
class SimResult:
    config: SimConfig
    workload: Workload
    sim_time_s: float = 0.0
    steps: int = 0
    consumed: list[Consumed] = field(default_factory=list)
    events: list[tuple[float, str, int]] = field(default_factory=list)
    trainer_busy_s: float = 0.0
    engine_busy_slot_s: float = 0.0
    generated_tokens: int = 0
    prefill_tokens: int = 0
    stale_dropped: int = 0
    stale_retried: int = 0
    dropped_ids: list[int] = field(default_factory=list)
    outstanding_ids: list[int] = field(default_factory=list)  # handed out, neither trained nor dropped
    handed_out: int = 0
    max_buffer: int = 0
    buffer_capacity: int = 0
    aborted_groups: int = 0
    checkpoints: dict[int, dict[str, Any]] = field(default_factory=dict)
    consumed_before: list[int] = field(default_factory=list)  # trained before the checkpoint it resumed from
    killed: bool = False

    def report(self) -> dict[str, Any]:
        w, t = self.workload, max(self.sim_time_s, 1e-9)
        samples = sum(c.samples for c in self.consumed)
        kept_tokens = sum(c.tokens for c in self.consumed)
        trained_tokens = sum(c.trained_tokens for c in self.consumed)
        generated = max(self.generated_tokens, 1)
        return {
            "label": self.config.label,
            "mode": self.config.mode,
            "max_staleness": self.config.max_staleness,
            "unused_handler": self.config.unused_handler,
            "sim_time_s": self.sim_time_s,
            "steps": self.steps,
            "trained_samples": samples,
            "samples_per_s": samples / t,
            "engine_busy": self.engine_busy_slot_s / (w.engines * w.slots_per_engine * t),
            "trainer_idle": 1.0 - self.trainer_busy_s / t,
            "staleness_hist": dict(sorted(Counter(c.staleness for c in self.consumed).items())),
            "staleness_mean": sum(c.staleness for c in self.consumed) / max(len(self.consumed), 1),
            "dropped_groups": self.stale_dropped,
            "retried_groups": self.stale_retried,
            "aborted_groups": self.aborted_groups,
            "in_flight": self.config.in_flight,
            "generated_tokens": self.generated_tokens,
            "trained_tokens": trained_tokens,
            # generated and in no trained sample (regenerated, dropped, cut, or still in flight at the end)
            "wasted_token_fraction": 1.0 - kept_tokens / generated,
            # in a trained sample as context only (older than the bound under `mask`, or masked off-policy)
            "masked_token_fraction": (kept_tokens - trained_tokens) / generated,
            "prefill_tokens": self.prefill_tokens,
            "prefill_per_trained_token": self.prefill_tokens / max(trained_tokens, 1),
            "trained_tokens_per_s": trained_tokens / t,
        }


class SimBackend(LoopBackend):
    """The loop's backend: slime's rollout code on simulated engines; the trainer and weight sync as sleeps."""

    def __init__(self, args: Any, result: SimResult, pool: EnginePool) -> None:
        self.args = args
        self.result = result
        self.w = result.workload
        self.config = result.config
        self.pool = pool
        self.data_source = RolloutDataSourceWithBuffer(args)
        self.pending: dict[int, list[Any]] = {}
        self.async_rollout: AsyncRollout | None = None
        self.async_state: dict[str, Any] | None = None  # to load when the producer starts (a resumed run)
        # the RolloutManager is one Ray actor: its methods run one at a time (a save waits for a rollout)
        self.manager = asyncio.Lock()

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    async def rollout(self, rollout_id: int) -> None:
        async with self.manager:
            await self._rollout(rollout_id)

    async def _rollout(self, rollout_id: int) -> None:
        if rollout_id in self.pending:  # restored from a checkpoint: generated before it, not yet trained
            return
        out, recycled = await generate_rollout_async(self.args, rollout_id, self.data_source, self.pool.abort_all)
        if recycled:
            self.data_source.add_samples(recycled)
        self.result.aborted_groups += len(recycled)
        groups, dropped, stale = filter_stale_groups(
            out.samples, rollout_id, self.args.max_weight_staleness, self.args.async_unused_samples_handler,
            self.data_source,
        )  # fmt: skip
        self.result.dropped_ids += [flatten(g)[0].group_index for g in dropped]
        self.result.stale_retried += int(stale.get("async/stale_retried_groups", 0))
        self.result.stale_dropped += int(stale.get("async/stale_dropped_groups", 0))
        self.pending[rollout_id] = groups

    async def train_data(self, rollout_id: int) -> Any:
        async with self.manager:
            return self.pending.pop(rollout_id)

    async def start_producer(self, rollout_id: int) -> None:
        args = self.args
        cls = load_function(args.custom_async_data_buffer_path) if args.custom_async_data_buffer_path else GroupBuffer
        buffer = cls(args, buffer_capacity(args))
        self.result.buffer_capacity = buffer.capacity
        self.async_rollout = AsyncRollout(
            async_config(args), self.data_source, buffer, SimGroupGenerator(args, self.pool), engine_version=rollout_id
        )
        if self.async_state is not None:
            self.async_rollout.load_state_dict(self.async_state)
        self.async_rollout.start(rollout_id)

    async def consume(self, rollout_id: int) -> Any:
        async with self.manager:
            groups, _ = await self.async_rollout.consume(rollout_id)
            return groups

    async def stop_producer(self) -> None:
        r = self.async_rollout
        if r is None:
            return
        t = r.totals()
        self.result.stale_dropped, self.result.stale_retried = (
            int(t["stale_dropped_groups"]),
            int(t["stale_retried_groups"]),
        )
        self.result.aborted_groups = int(t["aborted_groups"])
        self.result.dropped_ids = list(r.dropped_ids)
        self.result.max_buffer = r.max_buffer_size
        await r.stop()  # afterwards every unconsumed group is in the buffer or the data source
        self.result.outstanding_ids += [flatten(g)[0].group_index for g in r.buffer]

    async def train(self, rollout_id: int, batch: list[Any], keep_weights: bool) -> None:
        tokens = 0
        for group in batch:
            samples = flatten(group)
            spans = [[parse_version(v) for v, _, _ in s.weight_version_spans] for s in samples]
            trained = [parse_version(v) for s in samples for v, n, on in s.weight_version_spans if on and n > 0]
            response = sum(s.response_length for s in samples)
            tokens += sum(len(s.tokens) for s in samples)
            self.result.consumed.append(
                Consumed(
                    rollout_id, samples[0].group_index, group_staleness(group, rollout_id), len(samples), response,
                    spans, sum(s.effective_response_length for s in samples), trained,
                )
            )  # fmt: skip
        t = self.w.train_time(tokens)
        self.result.trainer_busy_s += t
        await asyncio.sleep(t)

    async def save(self, rollout_id: int) -> None:
        """What the RolloutManager checkpoints (data source, fully-async state, pending rollouts), plus the prompts
        trained so far (the trainer's part), as JSON taken in one step of the loop."""
        async with self.manager:
            ckpt = {
                "rollout_id": rollout_id,
                "data_source": self.data_source._state(),
                "async": self.async_rollout.state_dict() if self.async_rollout is not None else None,
                "pending": {rid: [group_to_json(g) for g in gs] for rid, gs in self.pending.items()},
                "consumed": self.result.consumed_before + [c.prompt_index for c in self.result.consumed],
                "dropped": list(self.result.dropped_ids),
            }
            self.result.checkpoints[rollout_id] = json.loads(json.dumps(ckpt))

    def load(self, ckpt: dict[str, Any]) -> None:
        self.data_source._set_state(ckpt["data_source"])
        self.pending = {int(rid): [group_from_json(g) for g in gs] for rid, gs in ckpt["pending"].items()}
        self.async_state = ckpt["async"]
        self.result.consumed_before = list(ckpt["consumed"])
        self.result.dropped_ids = list(ckpt["dropped"])

    async def sync_weights(self, version: int) -> None:
        r = self.async_rollout
        if r is not None and self.config.in_flight:  # SGLang's in_place pause: requests stay, decode stops
            r.hold()
            self.pool.pause_in_place()
            await asyncio.sleep(self.w.weight_sync_s)
            self.pool.set_version(version)
            self.pool.continue_generation()
            r.resume(version)
            return
        if self.async_rollout is not None:
            await self.async_rollout.pause()
        await asyncio.sleep(self.w.weight_sync_s)
        self.pool.set_version(version)
        if self.async_rollout is not None:
            self.async_rollout.resume(version)

    async def step_done(self, rollout_id: int, times: dict[str, float]) -> None:
        self.result.steps += 1
        if self.config.max_steps is None and self._now() >= self.config.horizon_s:
            raise _Horizon()


def simulate(config: SimConfig, workload: Workload = DEFAULT, resume: dict[str, Any] | None = None) -> SimResult:
    """Run one simulation to `config.horizon_s` simulated seconds (or `max_steps`); deterministic for a workload.
    `resume`: a checkpoint of an earlier run (`SimResult.checkpoints`) to continue from, as `--load` does."""
    args = sim_args(workload, config)
    result = SimResult(config, workload)

    async def main() -> None:
        pool = EnginePool(workload) if config.engine_model == "batched" else SlotPool(workload)
        CURRENT.set(_Current(workload, pool))
        backend = SimBackend(args, result, pool)
        start = 0
        if resume is not None:
            backend.load(resume)
            start = resume["rollout_id"] + 1
        plan = LoopPlan(
            mode="sync" if config.mode == "partial" else config.mode,
            start=start,
            num_rollout=args.num_rollout,
            update_weights_interval=config.update_weights_interval,
            save=config.save_interval is not None,
            save_interval=config.save_interval,
        )

        def record(kind: str, ident: int) -> None:
            result.events.append((asyncio.get_running_loop().time(), kind, ident))

        loop = asyncio.get_running_loop()
        run = loop.create_task(run_loop(plan, backend, record))
        if config.kill_at_s is not None:
            loop.call_at(config.kill_at_s, run.cancel)
        try:
            await run
        except _Horizon:
            pass
        except asyncio.CancelledError:
            result.killed = True
            return  # a dead process: nothing after the kill counts
        result.sim_time_s = asyncio.get_running_loop().time()
        pool.settle_accounting()
        result.engine_busy_slot_s = pool.busy_slot_s
        result.generated_tokens = pool.tokens
        result.prefill_tokens = pool.prefill_tokens
        ds = backend.data_source
        result.handed_out = ds.sample_group_index
        result.outstanding_ids += [flatten(g)[0].group_index for g in ds.buffer]
        result.outstanding_ids += [flatten(g)[0].group_index for gs in backend.pending.values() for g in gs]

    run_virtual(main())
    return result


@dataclass
class _Current:
    workload: Workload
    pool: EnginePool
