"""`--fully-async` on the RolloutManager: the pure producer/buffer/filter of `slime/scheduling/fully_async.py` run on
the manager's background event loop, generating through the router like the default rollout.

The manager is a Ray actor whose methods run on its own thread; the producer lives on the process's background
loop (`slime/utils/async_utils.py`). Every method here hands its work to that loop and waits, so the producer's
state (and the data source it draws from) is only ever touched from the loop's thread — which is also what
makes a checkpoint atomic: the data source and the fully-async state are written in one step of the loop.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from typing import Any

from slime.rollout.background_eval import BackgroundEval
from slime.rollout.data_source import call_with_checkpoint_dir, read_state
from slime.rollout.filter_hub.base_types import call_dynamic_filter
from slime.rollout.generate import GenerateState, base_sampling_params, generate_and_rm_group
from slime.rollout.sglang_rollout import abort_engines, seed_group
from slime.scheduling.fully_async import AsyncConfig, AsyncRollout, Group
from slime.scheduling.group_buffer import GroupBuffer
from slime.utils.async_utils import run
from slime.utils.atomic import atomic_open
from slime.utils.misc import load_function

logger = logging.getLogger(__name__)

# Sampling seeds are (--rollout-seed, rollout id, sample index); a fully-async sample belongs to no rollout when it
# starts, and its index is unique in the run, so one fixed rollout id keeps seeds distinct and reproducible.
SEED_ROLLOUT_ID = 0


class SGLangGroupGenerator:
    """Generates groups through the router with the default per-sample path (custom generate, reward, masks)."""

    def __init__(self, args: Any) -> None:
        self.args = args
        self.sampling_params = base_sampling_params(args)

    async def run_group(self, group: Group) -> Group:
        seed_group(self.args, SEED_ROLLOUT_ID, group)
        return await generate_and_rm_group(self.args, group, dict(self.sampling_params))

    async def abort_all(self) -> None:
        # queued samples see the flag before they send; running ones are aborted by their engines
        GenerateState.get(self.args).aborted = True
        await abort_engines(self.args)

    def allow(self) -> None:
        GenerateState.get(self.args).aborted = False


def async_config(args: Any) -> AsyncConfig:
    max_samples = args.async_max_concurrent_samples or args.rollout_batch_size * args.n_samples_per_prompt
    return AsyncConfig(
        batch_size=args.rollout_batch_size,
        max_in_flight_groups=max_samples // args.n_samples_per_prompt,
        max_staleness=args.max_weight_staleness,
        unused_handler=args.async_unused_samples_handler,
        in_flight_updates=args.update_weights_in_flight,
    )


def buffer_capacity(args: Any) -> int:
    return int(args.async_data_buffer_capacity_factor * args.rollout_batch_size)


def state_path(rollout_dir: str, rollout_id: int) -> str:
    return os.path.join(rollout_dir, f"fully_async_{rollout_id}.json")


class FullyAsyncRollout:
    """The manager's handle on the producer; blocking methods for the actor's thread."""

    def __init__(self, args: Any, data_source: Any) -> None:
        self.args = args
        self.data_source = data_source
        self.evals = BackgroundEval()
        run(self._build())

    async def _build(self) -> None:
        args = self.args
        buffer_cls = load_function(args.custom_async_data_buffer_path) if args.custom_async_data_buffer_path else None
        buffer = (buffer_cls or GroupBuffer)(args, buffer_capacity(args))
        filt = load_function(args.dynamic_sampling_filter_path) if args.dynamic_sampling_filter_path else None

        def keep_group(group: Group) -> tuple[bool, str | None]:
            verdict = call_dynamic_filter(filt, args, group)
            return verdict.keep, verdict.reason

        self.rollout = AsyncRollout(
            async_config(args),
            self.data_source,
            buffer,
            SGLangGroupGenerator(args),
            keep_group=keep_group if filt is not None else None,
        )

    def start(self, rollout_id: int, engine_version: int) -> None:
        async def go() -> None:
            self.rollout.engine_version = engine_version
            GenerateState.get(self.args).engine_version = engine_version
            self.rollout.start(rollout_id)

        run(go())

    def consume(self, rollout_id: int) -> tuple[list[Group], dict[str, float]]:
        return run(self.rollout.consume(rollout_id))

    # ---- evaluation in the background (slime/rollout/background_eval.py) ---------------------------------------
    def start_eval(self, rollout_id: int, fn: Callable[[], Any]) -> None:
        """Start the eval before `rollout_id` beside the producer, at the engines' current weight version."""
        self.evals.start(rollout_id, self.rollout.engine_version, fn)

    def finished_evals(self, wait: bool = False) -> list[tuple[int, int | None, Any]]:
        return self.evals.finished(wait)

    def pause(self) -> None:
        """Before a weight sync: a running eval finishes first (it keeps one weight version). In flight (`--update-weights-in-flight`) the producer only stops
        dispatching: the running requests stay, and the sync pauses the engines in place (`pause_mode`);
        otherwise every request is interrupted first and its group resumes afterwards."""
        self.evals.wait()
        if not self.args.update_weights_in_flight:
            run(self.rollout.pause())
            return

        async def go() -> None:
            self.rollout.hold()

        run(go())

    def resume(self, engine_version: int | None = None) -> None:
        async def go() -> None:
            if engine_version is not None:  # after the engines loaded it: a lower bound of what answers see next
                GenerateState.get(self.args).engine_version = engine_version
            self.rollout.resume(engine_version)

        run(go())

    def stop(self) -> None:
        self.evals.wait()
        run(self.rollout.stop())

    def save(self, rollout_id: int, rollout_dir: str) -> None:
        """The data source and the fully-async state in one step of the loop: nothing moves in between."""

        async def go() -> None:
            call_with_checkpoint_dir(self.data_source.save, rollout_id, rollout_dir)
            with atomic_open(state_path(rollout_dir, rollout_id)) as f:
                json.dump(self.rollout.state_dict(), f)

        run(go())

    def load(self, rollout_id: int, rollout_dir: str) -> None:
        """After the data source loaded its own state (the manager does that first)."""
        state = read_state(state_path(rollout_dir, rollout_id), "fully-async state", "starting with an empty buffer")
        if state is None:
            return

        async def go() -> None:
            self.rollout.load_state_dict(state)

        run(go())
