"""SGLang 0.5.23 wire shapes the fake speaks: sampling params, finish reasons, request state, `meta_info`.

Every field mirrored here names the SGLang source file it comes from; a fake that drifts from SGLang's real
shapes is a bug (docs/design.md §2.1, §6).
"""

from __future__ import annotations

import asyncio
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


class BadRequest(ValueError):
    """A client error; the server answers 400 like SGLang's `_create_error_response`."""


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
    def from_json(cls, d: dict[str, Any] | None) -> SamplingParams:
        d = dict(d or {})
        # Unknown keys are ignored, as SGLang ignores keys it does not know only for a few; we stay lenient
        # because slime passes through whatever `--sglang-*` sampling defaults the user set.
        kw = {k: d[k] for k in _SAMPLING_KEYS if k in d and d[k] is not None and k != "n"}
        stop = kw.get("stop")
        kw["stop"] = [stop] if isinstance(stop, str) else list(stop or [])
        kw["stop_token_ids"] = [int(t) for t in kw.get("stop_token_ids") or []]
        if int(d.get("n") or 1) != 1:
            raise BadRequest("fake_sglang supports n=1 only; send one request per sample")
        p = cls(**kw)
        if p.max_new_tokens is None or int(p.max_new_tokens) < 0:
            raise BadRequest(f"max_new_tokens must be at least 0, got {p.max_new_tokens}")
        if p.temperature < 0:
            raise BadRequest(f"temperature must be non-negative, got {p.temperature}")
        if not 0 < p.top_p <= 1:
            raise BadRequest(f"top_p must be in (0, 1], got {p.top_p}")
        if p.top_k == 0 or p.top_k < -1:
            raise BadRequest(f"top_k must be -1 (disable) or at least 1, got {p.top_k}")
        p.max_new_tokens = int(p.max_new_tokens)
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
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
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
    """Split a `/generate` body into per-prompt dicts; return (is_batch, items).

    python/sglang/srt/managers/io_struct.py: GenerateReqInput — `text` or `input_ids` (one prompt, or a list
    = a batch); `sampling_params`, `return_logprob`, `rid` may be one value or one per prompt; a single
    string `rid` for a batch is used as a prefix of per-item ids.
    """
    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise BadRequest("Either text or input_ids should be provided.")
    if text is not None:
        is_batch = isinstance(text, list)
        prompts = [{"text": t} for t in (text if is_batch else [text])]
    else:
        is_batch = bool(input_ids) and isinstance(input_ids[0], list)
        prompts = [{"input_ids": ids} for ids in (input_ids if is_batch else [input_ids])]
    n = len(prompts)

    def per_item(key: str, default: Any) -> list[Any]:
        v = body.get(key, default)
        if is_batch and isinstance(v, list):
            if len(v) != n:
                raise BadRequest(f"{key} has {len(v)} entries for {n} prompts")
            return v
        return [v] * n

    rid = body.get("rid")
    if is_batch:
        if isinstance(rid, list):
            rids = rid
        elif isinstance(rid, str):
            rids = [f"{rid}_{i}" for i in range(n)]
        else:
            rids = [new_rid() for _ in range(n)]
    else:
        rids = [rid if rid is not None else new_rid()]
    if len(set(rids)) != len(rids):
        raise BadRequest(f"Duplicate request IDs detected within the request: {rids}")

    sps = per_item("sampling_params", None)
    lps = per_item("return_logprob", False)
    items = []
    for i, p in enumerate(prompts):
        items.append(
            {
                **p,
                "rid": rids[i],
                "sampling_params": sps[i] or {},
                "return_logprob": bool(lps[i]),
                "return_text_in_logprobs": bool(body.get("return_text_in_logprobs", False)),
                "stream": bool(body.get("stream", False)),
            }
        )
    return is_batch, items


def build_response(req: GenRequest, text: str, weight_version: str, token_texts: list[str] | None) -> dict[str, Any]:
    """The `/generate` answer for one request.

    python/sglang/srt/managers/tokenizer_manager.py (`_handle_batch_output` / `convert_logprob_style`):
    `{text, output_ids, meta_info}`; meta_info carries id, finish_reason (None until finished), prompt_tokens,
    completion_tokens, cached_tokens, weight_version, e2e_latency and, with return_logprob,
    output_token_logprobs as `[logprob, token_id, text_or_None]` triples.
    """
    meta: dict[str, Any] = {
        "id": req.rid,
        "finish_reason": req.finish_reason,
        "prompt_tokens": len(req.prompt_ids),
        "weight_version": weight_version,
        "total_retractions": 0,
        "completion_tokens": len(req.output_ids),
        "cached_tokens": 0,
        "e2e_latency": (req.finished_at or time.time()) - req.created,
    }
    if req.return_logprob:
        meta["input_token_logprobs"] = []
        meta["output_token_logprobs"] = [
            [lp, tid, token_texts[i] if token_texts else None]
            for i, (lp, tid) in enumerate(zip(req.output_logprobs, req.output_ids, strict=True))
        ]
    return {"text": text, "output_ids": list(req.output_ids), "meta_info": meta}
