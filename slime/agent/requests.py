"""From a request body to an `ApiRequest`: parse and translate (`translate`), then hash, render and hold the
prompt to the served model's context (`measure`).

This is the CPU-heavy part of a request, and on a hostile body an unbounded one (a 50 MB chat body once kept
the event loop busy for two minutes, so `/health` and every other session waited). The gateway therefore runs
it on its event loop only while it is known to be cheap (`cheap_body`, then `cheap_shape` after the
translation) and in a prepare worker process otherwise (`slime.agent.prepare_pool`); both run these same
functions, so where a request was prepared never changes what it becomes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from slime.agent import anthropic_api, openai_api
from slime.agent.api import ApiRequest, parse_json_body
from slime.agent.context_limit import ContextLimit
from slime.agent.messages import BadRequest, message_hash, tools_hash

COUNT_TOKENS = "/messages/count_tokens"
TRANSLATE: dict[str, Callable[[dict[str, Any]], ApiRequest]] = {
    "/chat/completions": openai_api.chat_request,
    "/responses": openai_api.responses_request,
    COUNT_TOKENS: anthropic_api.count_tokens_request,
    "/messages": anthropic_api.messages_request,
}
# On the loop: parsing is ~50 ns/byte; rendering ~8 us per message and ~18 us per tool (2 cores, tiny
# template). Within these bounds one request costs the loop a few milliseconds at most.
INLINE_BODY_BYTES = 64 << 10
INLINE_SHAPE = 512  # messages + 2 x tools


def cheap_body(n_bytes: int) -> bool:
    return n_bytes <= INLINE_BODY_BYTES


def cheap_shape(req: ApiRequest) -> bool:
    return len(req.messages) + 2 * len(req.tools) <= INLINE_SHAPE


def translate(route: str, raw: bytes) -> ApiRequest:
    return TRANSLATE[route](parse_json_body(raw))


def measure(req: ApiRequest, builder: Any, limit: ContextLimit, *, count: bool) -> ApiRequest:
    """Hashes, the rendered prompt, and the context check: refused by its bytes alone when that proves it too
    long; with `count`, also tokenized when its bytes cannot tell (and always for count_tokens)."""
    try:
        req.text = builder.render(req.messages, req.tools, gen=True)
    except BadRequest:
        raise
    except Exception as e:  # the chat template rejected the messages (e.g. roles out of order)
        raise BadRequest(f"messages: cannot be rendered with the model's chat template: {e}") from e
    may_not_fit = limit.check_text(req.text)  # before hashing: a prompt refused here costs no more
    req.hashes = [message_hash(m) for m in req.messages]
    req.tools_hash = tools_hash(req.tools)
    if count and (may_not_fit or req.route == COUNT_TOKENS):
        req.ids = builder.encode(req.text)
        if req.route != COUNT_TOKENS:
            limit.check_ids(len(req.ids))
    return req


def prepare(route: str, raw: bytes, builder: Any, limit: ContextLimit) -> ApiRequest:
    """Everything at once, as a prepare worker does it."""
    return measure(translate(route, raw), builder, limit, count=True)
