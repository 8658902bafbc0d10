"""The scheduler shared by every fake engine: continuous batching, finish checks, abort, pause, release.

Why one loop for all engines: rollout code is exercised against SGLang's *scheduling* behaviour (requests
join a running batch, abort returns the tokens produced so far, pause holds new and running requests), and
that must not depend on whether tokens come from a real model, a script or a latency model. Engines only
implement `step()`: produce one token per running request.

Finish checks follow python/sglang/srt/managers/schedule_batch.py `Req.check_finished`: max_new_tokens first
(FINISH_LENGTH), then stop token ids / EOS unless `ignore_eos` (FINISH_MATCHED_TOKEN), then stop strings on
the decoded tail (FINISH_MATCHED_STR).
"""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from collections import deque
from typing import Any

import torch

from sim.fake_sglang.prefix_cache import PrefixCache, max_prefix_len
from sim.fake_sglang.protocol import (
    BadRequest,
    GenRequest,
    SamplingParams,
    finish_abort,
    finish_length,
    finish_matched,
    resolve_logprob_start,
)
from sim.fake_sglang.sampling import logprob_temperature, scripted_logprob
from sim.fake_sglang.weights import Received

# Per scored position: the log-prob of the prompt's next token, and the top-k (logprob, token_id) when asked.
ScoredPrompt = tuple[list[float], list[list[tuple[float, int]]] | None]
# One decode step's result for one request: (token_id, logprob), or with the top-k (logprob, token_id) pairs of
# the distribution it was drawn from as a third element (engines that have logits give it when asked).
StepResult = tuple[int, float] | tuple[int, float, list[tuple[float, int]]]
# python/sglang/srt/sampling/sampling_batch_info.py: with --enable-deterministic-inference a request without a
# sampling_seed is sampled with seed 42.
DEFAULT_DETERMINISTIC_SEED = 42

logger = logging.getLogger(__name__)

# python/sglang/srt/managers/io_struct.py: PauseGenerationReqInput.mode (default "abort").
PAUSE_MODES = ("abort", "retract", "in_place")


class Engine(ABC):
    """Owns all requests of one fake server; `run()` is the scheduler loop (one asyncio task)."""

    name = "base"
    model: Any = None  # the torch module of engines that hold weights (weights_checker reads it)

    def __init__(
        self,
        *,
        tokenizer: Any = None,
        max_running_requests: int = 64,
        random_seed: int = 0,
        deterministic: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_running_requests = max(1, max_running_requests)
        self.random_seed = random_seed
        # SGLang's --enable-deterministic-inference: only then is a request's sampling_seed honoured
        # (sampling_batch_info.py: `sampling_seed = ... if enable_deterministic else None`).
        self.deterministic = deterministic
        self.prefix_cache = PrefixCache()
        self._seed_counter = 0
        self.waiting: deque[GenRequest] = deque()
        self.running: list[GenRequest] = []
        self.requests: dict[str, GenRequest] = {}
        self.paused = False
        self.released_tags: set[str] = set()
        self.weight_version = "default"  # python/sglang/srt/server_args.py: weight_version default
        self.context_len: int | None = None  # the model's context length (set by the server); None: not checked
        self._wakeup = asyncio.Event()
        self._resumed = asyncio.Event()
        self._resumed.set()
        # Held during a decode step and during weight updates, so weights never change mid-step.
        self.step_lock = asyncio.Lock()
        self._stopping = False
        self.steps = 0

    # ---- engine hooks -------------------------------------------------------------------------------
    @abstractmethod
    async def step(self, batch: list[GenRequest]) -> list[StepResult]:
        """Return one (token_id, logprob) per request in `batch`, in order; a request with `top_logprobs_num` may
        get its top-k as a third element (the scheduler fills in `scripted_top` where none is given)."""

    def prepare(self, req: GenRequest) -> None:  # noqa: B027 - optional hook
        """Per-request setup when it is submitted (e.g. pick a scripted completion)."""

    def eos_token_ids(self) -> set[int]:
        return set()

    def vocab_size(self) -> int:
        return len(self.tokenizer) if self.tokenizer is not None else 0

    # ---- tokenizer helpers --------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            return list(text.encode())
        return list(self.tokenizer.encode(text))

    def decode(self, ids: list[int], skip_special_tokens: bool = True, spaces: bool = True) -> str:
        if self.tokenizer is None:
            return " ".join(str(i) for i in ids)
        return self.tokenizer.decode(
            ids, skip_special_tokens=skip_special_tokens, spaces_between_special_tokens=spaces
        )

    def output_text(self, req: GenRequest) -> str:
        """Detokenized output, trimmed like SGLang's detokenizer (`trim_matched_stop` unless no_stop_trim)."""
        p = req.params
        ids = req.output_ids
        fr = req.finish_reason or {}
        if not p.no_stop_trim and fr.get("type") == "stop" and isinstance(fr.get("matched"), int) and ids:
            ids = ids[:-1]
        text = self.decode(ids, p.skip_special_tokens, p.spaces_between_special_tokens)
        if not p.no_stop_trim and fr.get("type") == "stop" and isinstance(fr.get("matched"), str):
            pos = text.find(fr["matched"])
            if pos >= 0:
                text = text[:pos]
        return text

    def token_texts(self, req: GenRequest) -> list[str]:
        return [self.token_text(t) for t in req.output_ids]

    def token_text(self, token_id: int) -> str:
        return self.decode([token_id], skip_special_tokens=False)

    # ---- prompt scoring (return_logprob with logprob_start_len; max_new_tokens 0 = scoring only) -------------
    def score_prompt(self, prompt_ids: list[int], start: int, temperature: float, top_k: int) -> ScoredPrompt:
        """Log-probs of `prompt_ids[start + 1:]`, each given the tokens before it, at `temperature` (0 counts as 1),
        and with `top_k` > 0 the top-k of the distribution at each of those positions.

        Engines without a model report `scripted_logprob(token, position)`, with position the token's index in
        the sequence, and rank the whole vocabulary by the same formula for top-k; the `hf` engine runs its model.
        """
        lps = [scripted_logprob(t, p) for p, t in enumerate(prompt_ids) if p > start]
        if top_k <= 0:
            return lps, None
        return lps, [self.scripted_top(p, top_k) for p in range(start + 1, len(prompt_ids))]

    def scripted_top(self, position: int, top_k: int) -> list[tuple[float, int]]:
        """The top-k of engines without a model: the whole vocabulary ranked by `scripted_logprob(token, position)`."""
        vocab = torch.arange(self.vocab_size())
        if not len(vocab):
            raise BadRequest("top_logprobs_num needs a tokenizer (this engine serves none)")
        values = -(0.05 + ((31 * vocab + 17 * position) % 97).double() / 100.0)
        best = torch.topk(values, min(top_k, len(vocab)))  # ties resolve to torch.topk's order
        return list(zip(best.values.tolist(), best.indices.tolist(), strict=True))

    async def score_input(self, req: GenRequest) -> None:
        """Fill `req.input_logprobs` / `input_top_logprobs` in SGLang's layout: one entry per prompt token from
        `logprob_start_len` on, the first None (SGLang pads it; the last position's log-prob is the sampling one);
        none from the default start (len(prompt))."""
        start = resolve_logprob_start(req.logprob_start_len, len(req.prompt_ids))
        if start >= len(req.prompt_ids):
            req.input_logprobs, req.input_top_logprobs = [], ([] if req.top_logprobs_num > 0 else None)
            return
        temperature = logprob_temperature(req.params.temperature)
        async with self.step_lock:  # the weights must not change under a scoring forward
            lps, tops = await self._score_prompt_async(req.prompt_ids, start, temperature, req.top_logprobs_num)
        req.input_logprobs = [None, *lps]
        if tops is not None:
            req.input_top_logprobs = [None, *tops]

    async def _score_prompt_async(self, prompt_ids: list[int], start: int, temperature: float, top_k: int):
        return self.score_prompt(prompt_ids, start, temperature, top_k)

    # ---- request lifecycle --------------------------------------------------------------------------
    def _check_context(self, prompt_ids: list[int], sampling_params: dict[str, Any]) -> None:
        """tokenizer_manager.py `_validate_one_request` (SGLang 0.5.17, no auto-truncate, validate_total_tokens on):
        a prompt of at least the context length, or one whose max_new_tokens would not fit after it, is refused."""
        ctx = self.context_len
        if ctx is None:
            return
        n = len(prompt_ids)
        if n >= ctx:
            raise BadRequest(f"The input ({n} tokens) is longer than the model's context length ({ctx} tokens).")
        max_new = sampling_params.get("max_new_tokens")
        if max_new is not None and max_new + n > ctx:
            raise BadRequest(
                f"Requested token count exceeds the model's maximum context length of {ctx} tokens. You requested a "
                f"total of {max_new + n} tokens: {n} tokens from the input messages and {max_new} tokens for the "
                "completion. Please reduce the number of tokens in the input messages or the completion to fit "
                "within the limit."
            )

    def submit(self, item: dict[str, Any]) -> GenRequest:
        if self.released_tags:
            # SGLang has no KV cache / weights to run on after release_memory_occupation.
            raise BadRequest(f"memory is released (tags={sorted(self.released_tags)}); call resume_memory_occupation")
        vocab = self.vocab_size()
        params = SamplingParams.from_json(item.get("sampling_params"), vocab)
        if "input_ids" in item:
            prompt_ids = [int(t) for t in item["input_ids"]]
        else:
            prompt_ids = self.encode(item["text"])
        if not prompt_ids:  # an empty text: SGLang's scheduler would get a prompt of no tokens
            raise BadRequest("The input is empty: the prompt has no tokens.")
        # SGLang 0.5.23 does not range-check prompt ids before the model (an out-of-range id trips a device-side
        # assert in the embedding); the fake refuses them as the client error they are.
        if vocab and any(t < 0 or t >= vocab for t in prompt_ids):
            raise BadRequest(f"input_ids out of range for vocab size {vocab}")
        self._check_context(prompt_ids, item.get("sampling_params") or {})
        if item["rid"] in self.requests:
            raise BadRequest(f"Duplicate request ID: {item['rid']}")
        gen = torch.Generator()
        if self.deterministic:
            seed = params.sampling_seed if params.sampling_seed is not None else DEFAULT_DETERMINISTIC_SEED
            gen.manual_seed(int(seed))
        else:  # SGLang without --enable-deterministic-inference samples as if no seed were given
            self._seed_counter += 1
            gen.manual_seed(self.random_seed * 1_000_003 + self._seed_counter)
        return_logprob = item.get("return_logprob", False)
        start = int(item.get("logprob_start_len", -1))
        top_k = max(0, int(item.get("top_logprobs_num", 0)))
        if return_logprob:
            resolve_logprob_start(start, len(prompt_ids))  # refuse a start past the prompt before admitting it
        req = GenRequest(
            rid=item["rid"],
            prompt_ids=prompt_ids,
            params=params,
            return_logprob=return_logprob,
            return_text_in_logprobs=item.get("return_text_in_logprobs", False),
            stream=item.get("stream", False),
            generator=gen,
            logprob_start_len=start,
            top_logprobs_num=top_k,
        )
        self.prepare(req)
        self.requests[req.rid] = req
        if params.max_new_tokens == 0:  # scoring only: prefilled at once
            self._admit([req])
            req.finish(finish_length(0))
        else:
            self.waiting.append(req)
            self._wakeup.set()
        return req

    def forget(self, req: GenRequest) -> None:
        self.requests.pop(req.rid, None)

    def abort(self, rid: str | None = None, abort_all: bool = False, message: str | None = None) -> int:
        """Abort by rid (exact, or as a batch prefix `rid_i`) or all; return how many were aborted.

        scheduler.py `abort_request`: a running request finishes with FINISH_ABORT's default message "Aborted"
        (schedule_batch.py); one still in the waiting queue is dropped there and answered by the tokenizer manager
        with "Abort in waiting queue" and a shorter meta_info (protocol.build_response)."""
        n = 0
        waiting = {r.rid for r in self.waiting}
        for r in list(self.requests.values()):
            if r.finished:
                continue
            if abort_all or r.rid == rid or (rid and r.rid.startswith(f"{rid}_")):
                if r.rid in waiting:
                    r.aborted_waiting = True
                    r.finish({"type": "abort", "message": message or "Abort in waiting queue"})
                else:
                    r.finish(finish_abort(message or "Aborted"))
                n += 1
        self._drop_finished()
        return n

    def _drop_finished(self) -> None:
        self.running = [r for r in self.running if not r.finished]
        self.waiting = deque(r for r in self.waiting if not r.finished)

    @property
    def num_unfinished(self) -> int:
        return len(self.running) + len(self.waiting)

    async def pause(self, mode: str = "abort") -> None:
        if mode not in PAUSE_MODES:
            raise BadRequest(f"Invalid mode: {mode!r}. Expected one of {list(PAUSE_MODES)}.")
        self.paused = True
        self._resumed.clear()
        if mode == "abort":
            self.abort(abort_all=True)
        async with self.step_lock:  # return only once no step is in flight
            if mode == "retract":  # scheduler.py: running requests go back to the waiting queue, counted
                for r in self.running:
                    r.num_retractions += 1
                self.waiting.extendleft(reversed(self.running))
                self.running = []

    def continue_generation(self) -> None:
        self.paused = False
        self._resumed.set()
        self._wakeup.set()

    def release(self, tags: list[str] | None) -> None:
        if self.num_unfinished:
            raise BadRequest("release_memory_occupation needs an idle engine (pause or abort first)")
        released = set(tags or ["kv_cache", "weights", "cuda_graph"])
        if "kv_cache" in released:  # weight_updater.py release_memory_occupation flushes the cache with it
            self.prefix_cache.clear()
        self.released_tags |= released

    def resume(self, tags: list[str] | None) -> None:
        self.released_tags -= set(tags or ["kv_cache", "weights", "cuda_graph"])

    def flush_cache(self) -> bool:
        """SGLang refuses to flush while requests are running or waiting; a flush empties the prefix cache."""
        if self.num_unfinished:
            return False
        self.prefix_cache.clear()
        return True

    async def stop(self) -> None:
        self._stopping = True
        self.abort(abort_all=True, message="server shutting down")
        self._wakeup.set()
        self._resumed.set()

    # ---- weights (engines that have weights override) -------------------------------------------------
    async def load_named_tensors(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Default: accept and discard (scripted / synthetic engines have no weights)."""
        logger.info("%s engine: ignoring %d tensors (no weights)", self.name, len(named))

    async def load_received(self, received: Received) -> None:
        """One post of `/update_weights_from_tensor` (weights.decode); engines with weights copy it in place."""
        await self.load_named_tensors(received.named())

    async def load_from_disk(self, model_path: str) -> None:
        """Default: nothing to load."""
        logger.info("%s engine: nothing to load from %s", self.name, model_path)

    # ---- scheduler loop -----------------------------------------------------------------------------
    def _admit(self, reqs: list[GenRequest]) -> None:
        """A prefill batch (prefix_cache.py): each request matches the cache as it was, then the prompts go in."""
        fresh = [r for r in reqs if not r.admitted]
        for r in fresh:
            limit = max_prefix_len(len(r.prompt_ids), r.return_logprob, r.logprob_start_len)
            r.cached_tokens = min(self.prefix_cache.match(r.prompt_ids), limit)
            r.admitted = True
        for r in fresh:
            self.prefix_cache.insert(r.prompt_ids)

    def _check_finished(self, req: GenRequest) -> None:
        p = req.params
        if len(req.output_ids) >= p.max_new_tokens:
            req.finish(finish_length(p.max_new_tokens))
            return
        last = req.output_ids[-1]
        if not p.ignore_eos and (last in p.stop_token_ids or last in self.eos_token_ids()):
            req.finish(finish_matched(last))
            return
        if p.stop:
            window = max(len(s) for s in p.stop) + 8
            tail = self.decode(req.output_ids[-window:], p.skip_special_tokens, p.spaces_between_special_tokens)
            for s in p.stop:
                if s in tail:
                    req.finish(finish_matched(s))
                    return

    async def run(self) -> None:
        while not self._stopping:
            if self.paused:
                await self._resumed.wait()
                continue
            admitted = []
            while self.waiting and len(self.running) + len(admitted) < self.max_running_requests:
                admitted.append(self.waiting.popleft())
            self._admit(admitted)
            self.running += admitted
            if not self.running:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            batch = list(self.running)
            async with self.step_lock:
                try:
                    results = await self.step(batch)
                except Exception as e:  # a broken step must not hang clients: fail the batch loudly
                    logger.exception("engine step failed")
                    for r in batch:
                        r.finish(finish_abort(f"engine error: {e}"))
                    results = []
                self.steps += 1
            for req, res in zip(batch, results, strict=False):
                if req.finished:  # aborted while the step ran
                    continue
                if req.top_logprobs_num > 0:
                    top = res[2] if len(res) > 2 else None
                    position = len(req.prompt_ids) + len(req.output_ids)
                    req.output_top_logprobs.append(top or self.scripted_top(position, req.top_logprobs_num))
                req.output_ids.append(int(res[0]))
                req.output_logprobs.append(float(res[1]))
                self._check_finished(req)
                req.changed.set()
            for req in batch:
                if req.finished and not req.aborted_waiting:  # cache_finished_req: the tokens whose KV was computed
                    self.prefix_cache.insert(req.prompt_ids + req.output_ids[:-1])
            self._drop_finished()
            await asyncio.sleep(0)
