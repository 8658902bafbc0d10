"""SGLang wire shapes the fake speaks (every release of releases.py): sampling params, finish reasons, request state, `meta_info`.

Every field mirrored here names the SGLang source file it comes from: slime is tested against these shapes, so a
fake that drifts from SGLang's real ones hides the bugs it exists to find.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch

# python/sglang/srt/sampling/sampling_params.py: SamplingParams.__init__ keyword names and defaults.
_SAMPLING_KEYS = {
    "max_new_tokens": 128,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "stop": None,
    "stop_token_ids": None,
    "ignore_eos": False,
    "no_stop_trim": False,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "sampling_seed": None,
    "n": 1,
}
# Keys SGLang's verify() range-checks although the fake's sampler ignores them, with SGLang's defaults.
_VERIFIED_ONLY = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0, "min_new_tokens": 0}


class BadRequest(ValueError):
    """A client error SGLang reports as a ValueError: 400 `{"error": {"message": ...}}` (`_create_error_response`)."""


def _check_range(ok: bool, message: str) -> None:
    if not ok:
        raise BadRequest(message)


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    sampling_seed: int | None = None

    @classmethod
    def from_json(cls, d: dict[str, Any] | None, vocab_size: int = 0) -> SamplingParams:
        """Build from a body whose types contract.py has already checked; ranges are checked here with the
        messages of python/sglang/srt/sampling/sampling_params.py `SamplingParams.verify`."""
        d = dict(d or {})
        kw = {k: d[k] for k in _SAMPLING_KEYS if k in d and d[k] is not None and k != "n"}
        stop = kw.get("stop")
        kw["stop"] = [stop] if isinstance(stop, str) else list(stop or [])
        kw["stop_token_ids"] = [int(t) for t in kw.get("stop_token_ids") or []]
        if (d.get("n") or 1) != 1:
            raise BadRequest("fake_sglang supports n=1 only; send one request per sample")
        p = cls(**kw)
        # verify() reads these with SGLang's defaults for the keys the fake does not use
        extra = {k: d[k] if d.get(k) is not None else default for k, default in _VERIFIED_ONLY.items()}
        _check_range(math.isfinite(p.temperature) and p.temperature >= 0,
                     f"temperature must be a non-negative finite number, got {p.temperature}.")  # fmt: skip
        _check_range(0.0 < p.top_p <= 1.0, f"top_p must be in (0, 1], got {p.top_p}.")
        _check_range(0.0 <= p.min_p <= 1.0, f"min_p must be in [0, 1], got {p.min_p}.")
        _check_range(p.top_k == -1 or p.top_k >= 1, f"top_k must be -1 (disable) or at least 1, got {p.top_k}.")
        for name in ("frequency_penalty", "presence_penalty"):
            _check_range(-2.0 <= extra[name] <= 2.0, f"{name} must be in [-2, 2], got {extra[name]}.")
        rp = extra["repetition_penalty"]
        _check_range(0.0 < rp <= 2.0, f"repetition_penalty must be in (0, 2] (1.0 = no penalty), got {rp}.")
        mn = extra["min_new_tokens"]
        _check_range(mn >= 0, f"min_new_tokens must be in [0, max_new_tokens], got {mn}.")
        _check_range(p.max_new_tokens >= 0, f"max_new_tokens must be at least 0, got {p.max_new_tokens}.")
        _check_range(mn <= p.max_new_tokens, f"min_new_tokens must be in [0, max_new_tokens({p.max_new_tokens})], got {mn}.")  # fmt: skip
        for token_id in d.get("logit_bias") or {}:
            try:
                tid = int(token_id)
            except ValueError as e:
                raise BadRequest(str(e)) from None
            _check_range(not vocab_size or 0 <= tid < vocab_size,
                         f"logit_bias must has keys in [0, {vocab_size - 1}], got {token_id}.")  # fmt: skip
        seed = p.sampling_seed
        _check_range(seed is None or -(2**63) <= seed <= 2**63 - 1,
                     f"sampling_seed must be in [-2**63, 2**63 - 1], got {seed}.")  # fmt: skip
        return p


# python/sglang/srt/managers/schedule_batch.py: FINISH_LENGTH / FINISH_MATCHED_TOKEN / FINISH_MATCHED_STR /
# FINISH_ABORT `to_json()` shapes.
def finish_length(length: int) -> dict[str, Any]:
    return {"type": "length", "length": length}


def finish_matched(matched: int | str) -> dict[str, Any]:
    return {"type": "stop", "matched": matched}


def finish_abort(message: str = "Abort in waiting queue") -> dict[str, Any]:
    return {"type": "abort", "message": message, "status_code": None, "err_type": None}


@dataclass
class GenRequest:
    """One sequence being generated (SGLang's `Req`)."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False
    return_text_in_logprobs: bool = False
    stream: bool = False
    # io_struct.py GenerateReqInput: logprob_start_len (-1: only the last prompt token) and top_logprobs_num.
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    # Scored prompt tokens from `logprob_start_len` on (Engine.score_input); [0] is always None, as in SGLang.
    input_logprobs: list[float | None] | None = None
    input_top_logprobs: list[list[tuple[float, int]] | None] | None = None
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    # With top_logprobs_num: the top (logprob, token_id) pairs of the distribution each output token came from.
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    # Prompt tokens found in the prefix cache when admitted (prefix_cache.py) and times retracted (pause retract).
    cached_tokens: int = 0
    num_retractions: int = 0
    admitted: bool = False
    # Aborted while in the waiting queue: the tokenizer manager answers it itself (a shorter meta_info).
    aborted_waiting: bool = False
    # tokenizer_manager.py `_wait_one_response`: when the first answer (chunk) went to the client.
    response_sent_ts: float | None = None
    finish_reason: dict[str, Any] | None = None
    # Length of output to keep in the text when a stop string matched (SGLang trims text, not output_ids).
    text_cut: int | None = None
    created: float = field(default_factory=time.time)
    finished_at: float | None = None
    generator: torch.Generator | None = None
    # Set on every new token and on finish, so streaming handlers and waiters wake up.
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    # Set on finish only: a non-streaming handler sleeps through the tokens (one wake-up, not one per token).
    done: asyncio.Event = field(default_factory=asyncio.Event)
    engine_state: dict[str, Any] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def finish(self, reason: dict[str, Any]) -> None:
        if self.finish_reason is None:
            self.finish_reason = reason
            self.finished_at = time.time()
        self.changed.set()
        self.done.set()


def new_rid() -> str:
    return uuid.uuid4().hex


def normalize_generate_body(body: dict[str, Any]) -> tuple[bool, list[dict[str, Any]]]:
    """Split a contract-checked `/generate` body into per-prompt dicts; return (is_batch, items).

    python/sglang/srt/managers/io_struct.py: GenerateReqInput.normalize_batch_and_arguments — `text` or `input_ids`
    (one prompt, or a list = a batch; input_ids win when both are given, as in tokenizer_manager.py); `sampling_params`,
    `return_logprob`, `rid` may be one value or one per prompt; a single string `rid` for a batch is used as a prefix
    of per-item ids. Failures are ValueErrors there (400 `{"error": {"message"}}`), with the messages used here.
    """
    text, input_ids = body.get("text"), body.get("input_ids")
    if text is None and input_ids is None:
        raise BadRequest("Either text, input_ids or input_embeds should be provided.")
    if input_ids is not None:
        if not input_ids:
            raise BadRequest("input_ids cannot be empty.")
        is_batch = isinstance(input_ids[0], list)
        rows = input_ids if is_batch else [input_ids]
        if any(not r for r in rows):  # SGLang has no check of its own here: its scheduler gets an empty prompt
            raise BadRequest("input_ids cannot be empty.")
        prompts = [{"input_ids": ids} for ids in rows]
    else:
        is_batch = isinstance(text, list)
        texts = text if is_batch else [text]
        # SGLang's tokenizer raises TypeError on such a string; the fake refuses it as the client error it is.
        if any(has_lone_surrogate(t) for t in texts):
            raise BadRequest("text is not valid Unicode (a lone surrogate escape such as \\ud800); cannot tokenize")
        prompts = [{"text": t} for t in texts]
    n = len(prompts)

    def per_item(key: str, default: Any) -> list[Any]:
        v = body.get(key)
        v = default if v is None else v
        if isinstance(v, list):
            if not is_batch:
                raise BadRequest(f"{key} should be a single value for a single request, got a list")
            if len(v) != n:
                raise BadRequest(f"The length of {key} ({len(v)}) should be equal to the batch size ({n}).")
            return v
        return [v] * n

    rid = body.get("rid")
    if is_batch:
        if isinstance(rid, list):
            if len(rid) != n:
                raise BadRequest("The specified rids length mismatch with the batch_size for batch processing.")
            rids = rid
        elif isinstance(rid, str):
            rids = [f"{rid}_{i}" for i in range(n)]
        else:
            rids = [new_rid() for _ in range(n)]
    elif isinstance(rid, list):
        raise BadRequest("The rid should be a string for a single request.")
    else:
        rids = [rid if rid is not None else new_rid()]
    duplicates = sorted({r for r in rids if rids.count(r) > 1})
    if duplicates:
        raise BadRequest(f"Duplicate request IDs detected within the request: {duplicates}")

    sps = per_item("sampling_params", {})
    lps = per_item("return_logprob", False)
    starts = per_item("logprob_start_len", -1)
    tops = per_item("top_logprobs_num", 0)
    items = []
    for i, p in enumerate(prompts):
        items.append(
            {
                **p,
                "rid": rids[i],
                "sampling_params": sps[i] or {},
                "return_logprob": bool(lps[i]),
                "logprob_start_len": int(starts[i]),
                "top_logprobs_num": int(tops[i]),
                "return_text_in_logprobs": bool(body.get("return_text_in_logprobs")),
                "stream": bool(body.get("stream")),
            }
        )
    return is_batch, items


def has_lone_surrogate(s: str) -> bool:
    """JSON `"\\ud800"` decodes to a str that is not Unicode text (a surrogate pair decodes to one character)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def build_response(
    req: GenRequest,
    text: str,
    weight_version: str,
    token_texts: list[str] | None,
    decode: Any = None,
    *,
    sending: bool = True,
) -> dict[str, Any]:
    """The `/generate` answer (or one stream chunk) for one request, in every release the fake speaks.

    python/sglang/srt/managers/tokenizer_manager.py `_handle_batch_output`: `{text, output_ids, meta_info}`;
    meta_info holds id, finish_reason (null until finished), prompt_tokens, weight_version, num_retractions; with
    return_logprob (`add_logprob_to_meta_info`) input_token_logprobs and output_token_logprobs as
    `[logprob, token_id, text_or_None]` triples, output_token_logprobs_length and, with top_logprobs_num,
    input_top_logprobs / output_top_logprobs; then reasoning_tokens (0: no reasoning parser), completion_tokens,
    cached_tokens, cached_tokens_details (scheduler_components/output_streamer.py `get_cached_tokens_details`: null
    when nothing was cached, else `{"device": n, "host": 0}`), dp_rank (null with one data-parallel rank);
    e2e_latency once finished; and `response_sent_to_client_ts` on the first answer sent for the request
    (`_wait_one_response`: the first stream chunk, or the one answer of a non-streaming request). `sending`: this
    answer goes to the client (False for the request log's copy).

    input_token_logprobs cover the prompt from `logprob_start_len` on and start with a None log-prob
    (scheduler_output_processor_mixin.py `add_input_logprob_return_values` pads the first one); the default start
    (-1) with return_logprob scores no prompt token (scheduler.py `handle_generate_request`: the start becomes
    len(prompt)). `decode(token_id)` gives texts with return_text_in_logprobs.
    """
    if req.aborted_waiting:
        return _waiting_abort_response(req, text, weight_version, token_texts, decode, sending)
    meta: dict[str, Any] = {
        "id": req.rid,
        "finish_reason": req.finish_reason,
        "prompt_tokens": len(req.prompt_ids),
        "weight_version": weight_version,
        "num_retractions": req.num_retractions,
    }
    if req.return_logprob:
        _add_logprobs(meta, req, token_texts, decode)
    meta.update(
        reasoning_tokens=0,
        completion_tokens=len(req.output_ids),
        cached_tokens=req.cached_tokens,
        cached_tokens_details={"device": req.cached_tokens, "host": 0} if req.cached_tokens > 0 else None,
        dp_rank=None,
    )
    if req.finished:
        meta["e2e_latency"] = (req.finished_at or time.time()) - req.created
    _mark_sent(req, meta, sending)
    return {"text": text, "output_ids": list(req.output_ids), "meta_info": meta}


def _waiting_abort_response(
    req: GenRequest, text: str, weight_version: str, token_texts: list[str] | None, decode: Any, sending: bool
) -> dict[str, Any]:
    """tokenizer_manager.py `_handle_abort_req`: a request the scheduler dropped from its waiting queue (never
    admitted, or retracted back there) gets `{id, finish_reason, weight_version, e2e_latency}`, its log-probs so
    far, `completion_tokens`; a stream's answer carries only the last output id."""
    meta: dict[str, Any] = {
        "id": req.rid,
        "finish_reason": req.finish_reason,
        "weight_version": weight_version,
        "e2e_latency": (req.finished_at or time.time()) - req.created,
    }
    if req.return_logprob:
        _add_logprobs(meta, req, token_texts, decode)
    meta["completion_tokens"] = len(req.output_ids)
    _mark_sent(req, meta, sending)
    ids = req.output_ids[-1:] if req.stream else list(req.output_ids)
    return {"text": text, "output_ids": ids, "meta_info": meta}


def _mark_sent(req: GenRequest, meta: dict[str, Any], sending: bool) -> None:
    if sending and req.response_sent_ts is None and (req.stream or req.finished):
        req.response_sent_ts = time.time()
        meta["response_sent_to_client_ts"] = req.response_sent_ts


def _add_logprobs(meta: dict[str, Any], req: GenRequest, token_texts: list[str] | None, decode: Any) -> None:
    """tokenizer_manager.py `add_logprob_to_meta_info`."""

    def triple(lp: float | None, tid: int, text: str | None = None) -> list[Any]:
        return [lp, tid, text if text is not None else (decode(tid) if decode else None)]

    meta["input_token_logprobs"] = [
        triple(lp, tid) for lp, tid in zip(req.input_logprobs or [], _scored_ids(req), strict=True)
    ]
    meta["output_token_logprobs"] = [
        triple(lp, tid, token_texts[i] if token_texts else None)
        for i, (lp, tid) in enumerate(zip(req.output_logprobs, req.output_ids, strict=True))
    ]
    meta["output_token_logprobs_length"] = len(meta["output_token_logprobs"])
    if req.top_logprobs_num > 0:
        meta["input_top_logprobs"] = [
            None if top is None else [triple(lp, tid) for lp, tid in top] for top in req.input_top_logprobs or []
        ]
        meta["output_top_logprobs"] = [[triple(lp, tid) for lp, tid in top] for top in req.output_top_logprobs]


def _scored_ids(req: GenRequest) -> list[int]:
    return req.prompt_ids[resolve_logprob_start(req.logprob_start_len, len(req.prompt_ids)) :]


def resolve_logprob_start(logprob_start_len: int, prompt_len: int) -> int:
    """Where input log-probs start. scheduler.py `handle_generate_request`: -1 (the default) with return_logprob
    becomes len(prompt) (no prompt token scored); a start past the prompt's end is refused (an abort with status
    400, which the tokenizer manager answers as the client's error). A start below -1 SGLang does not check; the
    fake refuses it."""
    if logprob_start_len == -1:
        return prompt_len
    if logprob_start_len < -1:
        raise BadRequest(f"logprob_start_len must be -1 or >= 0, got {logprob_start_len}.")
    if logprob_start_len > prompt_len:
        raise BadRequest(
            f"req.logprob_start_len={logprob_start_len} is higher than the number of input tokens "
            f"len(req.origin_input_ids)={prompt_len}. Please use a smaller logprob_start_len."
        )
    return logprob_start_len
