"""The default rollout function (`--rollout-function-path slime.rollout.sglang_rollout.generate_rollout`).

DAPO-style over-sampling: keep `rollout_batch_size` prompt groups in flight, pull `over_sampling_batch_size`
more whenever accepted + in-flight falls short, drop the groups the dynamic filter rejects, and once enough
are accepted abort what is still running. With `--partial-rollout` the unfinished (and surplus) groups go
back to the data source's buffer instead of being thrown away.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from slime.rollout.base_types import RolloutFnEvalOutput, RolloutFnTrainOutput
from slime.rollout.dataset import Dataset, build_eval_dataset, eval_dataset_specs
from slime.rollout.filter_hub.base_types import call_dynamic_filter
from slime.rollout.generate import (
    GenerateState,
    base_sampling_params,
    derive_sampling_seed,
    flatten_group,
    generate,
    generate_and_rm,
    generate_and_rm_group,
    get_model_url,
)
from slime.utils.async_utils import run
from slime.utils.http_utils import get_json, post_json
from slime.utils.misc import load_function
from slime.utils.types import Sample, Status

__all__ = [
    "abort",
    "abort_engines",
    "eval_rollout",
    "generate",
    "generate_and_rm",
    "generate_and_rm_group",
    "generate_rollout",
    "generate_rollout_async",
    "get_model_url",
    "seed_group",
]

logger = logging.getLogger(__name__)


def _group_order_key(group: list[Sample | list[Sample]]) -> int:
    first = flatten_group(group)[0]
    return first.index if first.index is not None else -1


def seed_group(args: Any, rollout_id: int, group: list[Sample]) -> None:
    # Set once, when a sample is first handed to the engines: a partial sample resumed from the buffer (or
    # from a checkpoint) keeps its seed, so the run is reproducible across restarts.
    for s in flatten_group(group):
        if s.index is not None and "sampling_seed" not in s.metadata:
            s.metadata["sampling_seed"] = derive_sampling_seed(int(args.rollout_seed), rollout_id, s.index)


AbortEngines = Callable[[], Awaitable[None]]


async def abort(
    args: Any, rollout_id: int, pending: dict[asyncio.Task, list[Sample]], abort_all: AbortEngines | None = None
) -> list[list[Sample]]:
    """Stop in-flight work; return the groups to recycle (only with `--partial-rollout`).

    Without partial rollout the results are discarded, so tasks are cancelled first: waiting on them would
    also wait on slow reward judges (THUDM/slime#2176). With partial rollout the engines are told to abort and
    the tasks drained, because an aborted `/generate` still returns the tokens produced so far. `abort_all`
    replaces the call to every engine behind the router (the scheduling simulator passes its engines')."""
    state = GenerateState.get(args)
    state.aborted = True
    partial = bool(args.partial_rollout)
    if not partial:
        for task in pending:
            task.cancel()
    await (abort_all() if abort_all is not None else abort_engines(args))
    results = await asyncio.gather(*pending, return_exceptions=True)
    if not partial:
        return []
    recycled = []
    for original, res in zip(pending.values(), results, strict=True):
        if isinstance(res, BaseException):
            logger.warning("rollout task failed during abort (%r); recycling its group unchanged", res)
            res = original
        for s in flatten_group(res):
            if s.response and "start_rollout_id" not in s.metadata:
                s.metadata["start_rollout_id"] = rollout_id
        recycled.append(res)
    return recycled


async def abort_engines(args: Any) -> None:
    """`/abort_request {"abort_all": true}` to every worker the router lists: running requests return now."""
    if args.sglang_router_ip is None:
        return
    try:
        listing = await get_json(get_model_url(args, endpoint="/workers"), max_retries=1)
    except Exception as e:  # the rollout is already complete; a failed abort only wastes engine time
        logger.warning("cannot list router workers for abort: %r", e)
        return
    # sglang-router 0.3.2 GET /workers: {"workers": [{"id", "url", "worker_type", "is_healthy", ...}], "total", ...}
    urls = [w["url"] for w in listing.get("workers", []) if w.get("url")]

    async def one(url: str) -> None:
        try:
            await post_json(f"{url.rstrip('/')}/abort_request", {"abort_all": True}, timeout=30.0, max_retries=1)
        except Exception as e:
            logger.warning("abort_request to %s failed: %r", url, e)

    await asyncio.gather(*(one(u) for u in urls))


def _metrics(args: Any, groups: list[list[Any]], drops: Counter, num_generated: int) -> dict[str, Any]:
    flat = [s for g in groups for s in flatten_group(g)]
    m: dict[str, Any] = {"rollout/num_groups": len(groups), "rollout/num_samples": len(flat)}
    m["rollout/num_groups_generated"] = num_generated
    if flat:
        m["rollout/response_len_mean"] = sum(s.response_length for s in flat) / len(flat)
        m["rollout/truncated_ratio"] = sum(s.status == Status.TRUNCATED for s in flat) / len(flat)
        try:
            m["rollout/reward_mean"] = sum(s.get_reward_value(args) for s in flat) / len(flat)
        except (ValueError, KeyError, TypeError) as e:
            logger.warning("rollout/reward_mean not logged: %s", e)
    for reason, count in drops.items():
        m[f"rollout/dynamic_filter/drop_{reason}"] = count
    return m


async def generate_rollout_async(
    args: Any, rollout_id: int, data_source: Any, abort_all: AbortEngines | None = None
) -> tuple[RolloutFnTrainOutput, list[list[Sample]]]:
    """Returns the accepted groups (sorted by index) and the groups to put back into the buffer."""
    state = GenerateState.get(args)
    state.reset()
    target = int(args.rollout_batch_size)
    per_round = args.over_sampling_batch_size
    n = args.n_samples_per_prompt
    filt_path = args.dynamic_sampling_filter_path
    dynamic_filter = load_function(filt_path) if filt_path else None

    pending: dict[asyncio.Task, list[Sample]] = {}
    accepted: list[list[Any]] = []
    generated: list[list[Any]] = []
    surplus: list[list[Any]] = []
    drops: Counter = Counter()
    try:
        while len(accepted) < target:
            while len(accepted) + len(pending) < target:
                groups = data_source.get_samples(per_round)
                if not groups:
                    raise RuntimeError("data source returned no groups; cannot fill the rollout batch")
                for g in groups:
                    seed_group(args, rollout_id, g)
                    task = asyncio.create_task(generate_and_rm_group(args, g, state.sampling_params))
                    pending[task] = g
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=lambda t: _group_order_key(pending[t])):
                del pending[task]
                group = task.result()
                if len(group) != n:
                    raise RuntimeError(
                        f"a rollout group has {len(group)} trajectories; expected n_samples_per_prompt={n}"
                    )
                generated.append(group)
                verdict = call_dynamic_filter(dynamic_filter, args, group)
                if not verdict.keep:
                    drops[verdict.reason or "filtered"] += 1
                elif len(accepted) < target:
                    accepted.append(group)
                else:
                    surplus.append(group)
    except BaseException:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        state.reset()
        raise

    recycled = await abort(args, rollout_id, pending, abort_all)
    if args.partial_rollout:
        recycled = surplus + recycled
        logger.info("rollout %d: %d group(s) go back to the buffer", rollout_id, len(recycled))
    state.reset()

    accepted.sort(key=_group_order_key)
    generated.sort(key=_group_order_key)
    if path := args.rollout_sample_filter_path:
        load_function(path)(args, accepted)
    if path := args.rollout_all_samples_process_path:
        load_function(path)(args, generated, data_source)
    metrics = _metrics(args, accepted, drops, len(generated))
    return RolloutFnTrainOutput(samples=accepted, metrics=metrics), recycled


_EVAL_DATASETS: dict[tuple, Dataset] = {}


async def eval_rollout(args: Any, rollout_id: int) -> RolloutFnEvalOutput:
    """Every `--eval-prompt-data` dataset, `n_samples_per_eval_prompt` samples per prompt."""
    GenerateState.get(args).reset()
    results = await asyncio.gather(
        *(_eval_one(args, rollout_id, name, path) for name, path in eval_dataset_specs(args))
    )
    data = dict(results)
    metrics: dict[str, Any] = {}
    for name, d in data.items():
        numeric = [float(r) for r in d["rewards"] if isinstance(r, (int, float))]
        if numeric:
            metrics[f"eval/{name}"] = sum(numeric) / len(numeric)
        if d["truncated"]:
            metrics[f"eval/{name}/truncated_ratio"] = sum(d["truncated"]) / len(d["truncated"])
    return RolloutFnEvalOutput(data=data, metrics=metrics)


async def _eval_one(args: Any, rollout_id: int, name: str, path: str) -> tuple[str, dict[str, list[Any]]]:
    key = (name, path, args.hf_checkpoint, bool(args.apply_chat_template))
    if key not in _EVAL_DATASETS:
        _EVAL_DATASETS[key] = build_eval_dataset(args, name, path)
    dataset = _EVAL_DATASETS[key]
    n = args.n_samples_per_eval_prompt
    params = base_sampling_params(args, evaluation=True)
    seed = int(args.rollout_seed)
    # Common random numbers: with a fixed seed, a sampled eval at T>0 changes between two evals only where the
    # weights changed, so a flat curve really is flat instead of moving by the sampling noise of each eval.
    seed_rollout_id = 0 if args.eval_fixed_sampling_seed else rollout_id
    samples = []
    for prompt in dataset.samples:
        for _ in range(n):
            s = copy.deepcopy(prompt)
            s.group_index = len(samples) // n
            s.index = len(samples)
            s.metadata["sampling_seed"] = derive_sampling_seed(seed, seed_rollout_id, s.index)
            samples.append(s)
    if args.group_rm:  # each prompt's n samples are scored together, as in training
        groups = [samples[i : i + n] for i in range(0, len(samples), n)]
        outs = [
            o for g in await asyncio.gather(*(generate_and_rm_group(args, g, params, True) for g in groups)) for o in g
        ]
    else:
        outs = await asyncio.gather(*(generate_and_rm(args, s, params, evaluation=True) for s in samples))
    flat = [s for o in outs for s in (o if isinstance(o, list) else [o])]
    flat.sort(key=lambda s: s.index if s.index is not None else -1)
    reward_key = args.eval_reward_key or args.reward_key
    rewards = [s.reward[reward_key] if reward_key and isinstance(s.reward, dict) else s.reward for s in flat]
    return name, {"rewards": rewards, "truncated": [s.status == Status.TRUNCATED for s in flat], "samples": flat}


def generate_rollout(
    args: Any, rollout_id: int, data_source: Any, evaluation: bool = False
) -> RolloutFnTrainOutput | RolloutFnEvalOutput:
    """Sync entry point (the RolloutManager calls it); the async work runs on the shared background loop."""
    if evaluation:
        return run(eval_rollout(args, rollout_id))
    output, recycled = run(generate_rollout_async(args, rollout_id, data_source))
    if recycled:
        data_source.add_samples(recycled)
    return output
