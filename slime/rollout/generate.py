"""Per-sample generation against the SGLang router: the default `generate`, and `generate_and_rm`, which wraps
any generate function (default or `--custom-generate-function-path`) with the concurrency limit and reward.

Wire format mirrored from SGLang 0.5.23 (python/sglang/srt/managers/io_struct.py `GenerateReqInput`: input_ids,
sampling_params, return_logprob; python/sglang/srt/entrypoints/http_server.py `/generate`, whose answer is
`{text, output_ids, meta_info}` with `meta_info.output_token_logprobs = [[logprob, token_id, text|None], ...]`
and `meta_info.finish_reason = {"type": "length"|"stop"|"abort", ...}`).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import inspect
import logging
from typing import Any

import aiohttp

from slime.rollout.dataset import load_tokenizer
from slime.rollout.model_scoring import attach_model_log_probs, needs_model_scoring
from slime.rollout.model_urls import get_model_url
from slime.rollout.rm_hub import async_rm, batched_async_rm
from slime.scheduling.staleness import bound_answer_version, mark_context_only
from slime.utils.fifo_semaphore import FifoSemaphore
from slime.utils.http_utils import get_session, post_json
from slime.utils.misc import load_function
from slime.utils.types import Sample, Status

logger = logging.getLogger(__name__)

# sglang-router (SGLang Model Gateway) pins each value of this header to one engine under slime's
# `--router-policy consistent_hashing` (0.3.2's `manual` policy, docs/router.md), so every turn of a session,
# and every sample of a prompt group, lands on the engine that holds its prefix in cache.
ROUTING_KEY_HEADER = "X-SMG-Routing-Key"


async def post_generate_with_failover(
    args: Any, url: str, payload: dict[str, Any], headers: dict[str, str] | None
) -> dict[str, Any]:
    """`--use-fault-tolerance`: a `/generate` that fails because its engine died (connection lost, 5xx from
    the router) is sent again, whole, until another engine answers. Nothing of a failed attempt is kept, so
    a sample's tokens always come from one engine. 4xx answers are the request's fault and are raised.

    The retry window covers the health monitor's detection time (interval + timeout), after which the dead
    engine is off the router and the retry lands elsewhere."""
    window = 2 * (float(args.rollout_health_check_interval) + float(args.rollout_health_check_timeout)) + 30.0
    deadline = asyncio.get_running_loop().time() + window
    delay = 0.2
    attempt = 0
    while True:
        attempt += 1
        try:
            async with get_session().post(url, json=payload, headers=headers) as resp:
                if resp.status < 400:
                    return await resp.json(content_type=None)
                body = (await resp.text())[:300]
                if resp.status < 500:
                    raise RuntimeError(f"POST {url} -> HTTP {resp.status}: {body}")
                failure = f"HTTP {resp.status}: {body}"
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as e:
            failure = repr(e)
        if asyncio.get_running_loop().time() > deadline:
            raise RuntimeError(f"POST {url} failed for {window:.0f}s over {attempt} attempts; last: {failure}")
        logger.warning("generate attempt %d failed (%s); retrying from scratch", attempt, failure)
        await asyncio.sleep(delay)
        delay = min(delay * 2, 2.0)


def derive_sampling_seed(rollout_seed: int, rollout_id: int, index: int) -> int:
    """A seed fixed by (seed, rollout, trajectory), so a resumed run regenerates what the lost run generated.
    A hash, not a sum, so neighbouring rollouts/indices do not share seeds."""
    digest = hashlib.blake2b(f"{rollout_seed}:{rollout_id}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (2**31 - 1)


def flatten_group(group: list[Sample | list[Sample]]) -> list[Sample]:
    return [s for item in group for s in (item if isinstance(item, list) else [item])]


def base_sampling_params(args: Any, evaluation: bool = False) -> dict[str, Any]:
    """SGLang sampling params from the flags; `--eval-*` values default to the rollout ones."""

    def pick(eval_value: Any, rollout_value: Any) -> Any:
        return eval_value if evaluation and eval_value is not None else rollout_value

    params: dict[str, Any] = {
        "temperature": pick(args.eval_temperature, args.rollout_temperature),
        "top_p": pick(args.eval_top_p, args.rollout_top_p),
        "top_k": pick(args.eval_top_k, args.rollout_top_k),
        "max_new_tokens": pick(args.eval_max_response_len, args.rollout_max_response_len),
        "stop": args.rollout_stop,
        "stop_token_ids": args.rollout_stop_token_ids,
        "skip_special_tokens": bool(args.rollout_skip_special_tokens),
        # keep the stop token in output_ids: the trainer must see the exact tokens the policy sampled
        "no_stop_trim": True,
        "spaces_between_special_tokens": False,
    }
    if evaluation and args.eval_min_new_tokens is not None:
        params["min_new_tokens"] = args.eval_min_new_tokens
    return params


class GenerateState:
    """Per-process generation state bound to one `args` and one event loop (a semaphore cannot cross loops)."""

    _current: GenerateState | None = None

    def __init__(self, args: Any, loop: asyncio.AbstractEventLoop) -> None:
        self.args = args
        self.loop = loop
        num_gpus = args.rollout_num_gpus or 1  # 0 with --rollout-external: one engine per address
        per_engine = args.rollout_num_gpus_per_engine
        concurrency = args.sglang_server_concurrency
        # FIFO with O(1) release: asyncio.Semaphore's is quadratic in its waiters (slime/utils/fifo_semaphore.py)
        self.semaphore = FifoSemaphore(max(1, concurrency * max(1, num_gpus // per_engine)))
        self.sampling_params = base_sampling_params(args)
        self.aborted = False
        self.engine_version: int | None = None  # the engines' weight version, as the fully-async producer knows it
        # prompt text -> token ids: the n samples of a prompt (and every eval round) tokenise it once
        self.encode = functools.lru_cache(maxsize=16384)(self._encode)

    def _encode(self, text: str) -> tuple[int, ...]:
        return tuple(self.tokenizer.encode(text, add_special_tokens=False))

    @classmethod
    def get(cls, args: Any) -> GenerateState:
        loop = asyncio.get_running_loop()
        cur = cls._current
        if cur is None or cur.args is not args or cur.loop is not loop:
            cur = cls._current = cls(args, loop)
        return cur

    @property
    def tokenizer(self) -> Any:
        return load_tokenizer(self.args.hf_checkpoint)

    def reset(self) -> None:
        self.aborted = False


def _prompt_ids(state: GenerateState, sample: Sample) -> list[int]:
    tok = state.tokenizer
    prompt = sample.prompt
    if not isinstance(prompt, str):
        prompt = tok.apply_chat_template(
            prompt, tools=sample.metadata.get("tools"), tokenize=False, add_generation_prompt=True
        )
    return list(state.encode(prompt))


async def generate(args: Any, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    """One `/generate` call that continues `sample` (a fresh prompt, or a partial rollout from the buffer)."""
    if sample.status not in (Status.PENDING, Status.ABORTED):
        raise ValueError(f"generate: sample {sample.index} has status {sample.status.value}; nothing to continue")
    state = GenerateState.get(args)
    # `tokens` already holds prompt + earlier response for a partial sample; only fresh prompts are tokenised.
    input_ids = list(sample.tokens) if sample.tokens else _prompt_ids(state, sample)
    if not sample.tokens:
        sample.tokens = list(input_ids)

    params = dict(sampling_params)
    budget = params.get("max_new_tokens")
    if budget is not None:
        # A continuation only gets what is left of the response budget (THUDM/slime#2261).
        budget -= sample.response_length
    if (ctx := args.rollout_max_context_len) is not None:
        budget = ctx - len(input_ids) if budget is None else min(budget, ctx - len(input_ids))
    if budget is not None and budget <= 0:
        sample.status = Status.TRUNCATED
        return sample
    params["max_new_tokens"] = budget
    if "sampling_seed" not in params and (seed := sample.metadata.get("sampling_seed")) is not None:
        params["sampling_seed"] = seed

    sent_under = state.engine_version if args.update_weights_in_flight else None
    payload = {"input_ids": input_ids, "sampling_params": params, "return_logprob": True}
    key = sample.session_id if sample.session_id is not None else sample.group_index
    headers = {ROUTING_KEY_HEADER: str(key)} if key is not None else None
    if args.use_fault_tolerance:
        out = await post_generate_with_failover(args, get_model_url(args), payload, headers)
    else:
        out = await post_json(get_model_url(args), payload, headers=headers)

    meta = out.get("meta_info") or {}
    logprob_items = meta.get("output_token_logprobs") or []
    new_ids = out.get("output_ids")
    if new_ids is None:
        new_ids = [int(item[1]) for item in logprob_items]
    if logprob_items and len(logprob_items) != len(new_ids):
        raise RuntimeError(
            f"/generate answered {len(new_ids)} output_ids but {len(logprob_items)} output_token_logprobs"
        )
    sample.tokens = sample.tokens + list(new_ids)
    sample.response += out.get("text") or ""
    sample.response_length += len(new_ids)
    if logprob_items:
        sample.rollout_log_probs = (sample.rollout_log_probs or []) + [float(item[0]) for item in logprob_items]
    if sample.loss_mask is not None:
        sample.loss_mask = sample.loss_mask + [1] * len(new_ids)
    sample.update_from_meta_info(args, meta)
    bound_answer_version(sample, sent_under)
    return sample


@functools.lru_cache(maxsize=64)
def _takes_evaluation(fn: Any) -> bool:
    """Asked once per function: `inspect.signature` on every sample was ~15% of the driver's CPU per sample
    (bench/orchestration_scale.py)."""
    return "evaluation" in inspect.signature(fn).parameters


async def _call_generate_fn(
    args: Any, sample: Sample, params: dict[str, Any], evaluation: bool
) -> Sample | list[Sample]:
    path = sample.generate_function_path or args.custom_generate_function_path
    if not path:
        return await generate(args, sample, params)
    fn = load_function(path)
    if _takes_evaluation(fn):
        return await fn(args, sample, params, evaluation=evaluation)
    return await fn(args, sample, params)


async def generate_and_rm(
    args: Any, sample: Sample, sampling_params: dict[str, Any], evaluation: bool = False
) -> Sample | list[Sample]:
    """Generate one trajectory (maybe several samples: fan-out) and score it unless `--group-rm` scores later."""
    if (args.partial_rollout or args.fully_async) and args.mask_offpolicy_in_partial_rollout:
        if sample.response_length > 0:
            # tokens from an older policy stay in the context but are not trained on (nor count as stale)
            mark_context_only(sample)

    state = GenerateState.get(args)
    result: Sample | list[Sample] = sample
    if sample.status not in (Status.COMPLETED, Status.TRUNCATED):  # finished ones come back from the buffer
        async with state.semaphore:
            if state.aborted:
                sample.status = Status.ABORTED
                return sample
            params = dict(sampling_params)
            if (seed := sample.metadata.get("sampling_seed")) is not None:
                params["sampling_seed"] = seed
            result = await _call_generate_fn(args, sample, params, evaluation)

    if args.group_rm:
        return result  # the group is scored as a whole (generate_and_rm_group), in training and evaluation alike
    samples = result if isinstance(result, list) else [result]
    if any(s.status == Status.ABORTED for s in samples):
        return result
    need = [s for s in samples if s.reward is None]
    if len(need) == 1 and not isinstance(result, list):
        need[0].reward = await async_rm(args, need[0])
    elif need:
        for s, r in zip(need, await batched_async_rm(args, need), strict=True):
            s.reward = r
    return result


async def generate_and_rm_group(
    args: Any, group: list[Sample], sampling_params: dict[str, Any], evaluation: bool = False
) -> list[Sample | list[Sample]]:
    """All trajectories of one prompt concurrently; with `--group-rm` the group is scored as a whole."""
    state = GenerateState.get(args)
    if state.aborted:
        return group
    results = list(await asyncio.gather(*(generate_and_rm(args, s, dict(sampling_params), evaluation) for s in group)))
    if not evaluation and needs_model_scoring(args) and not state.aborted:
        await attach_model_log_probs(args, flatten_group(results))  # teachers / reference, one request per model
    if args.group_rm and not state.aborted:
        flat = flatten_group(results)
        if not any(s.status == Status.ABORTED for s in flat):
            for s, r in zip(flat, await batched_async_rm(args, flat), strict=True):
                s.reward = r
    return results
