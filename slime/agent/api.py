"""What the gateway and its API handlers (`openai_api`, `anthropic_api`) share: the gateway as a handler sees
it (`TurnRunner`), a turn's result, request bodies and client sampling knobs, error bodies in each API's own
shape, and the server-sent-events helpers.

It lives apart from `gateway.py` so that the handlers never import the gateway that routes to them.

Why the body checks are strict: a client mistake must be answered 4xx, never 5xx, because Claude Code and the
OpenAI SDKs retry 5xx for a minute or more, and an agent episode would stall on its own malformed request.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from aiohttp import web

from slime.agent.chains import RequestHints
from slime.agent.engine_client import EngineError
from slime.agent.messages import BadRequest
from slime.agent.parsing import ParsedOutput
from slime.agent.session import Session
from slime.agent.stores import StoreError

OPENAI, ANTHROPIC, ADMIN = "openai", "anthropic", "admin"
MAX_JSON_DEPTH = 100  # real clients nest < 20 deep (JSON schemas of tools); the chat template recurses on it
TOP_K_ALL = 1 << 30  # SGLang's "no top-k"
ENGINE_MS_HEADER = "X-Slime-Engine-Ms"
_SURROGATE = re.compile("[\ud800-\udfff]")
_SSE = web.RequestKey("slime_agent_sse", web.StreamResponse)  # the stream, once the SSE preamble went out
_ANTHROPIC_KINDS = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}


class Unavailable(Exception):
    """A part of the gateway could not serve the request just now (a prepare worker died): retryable, 503."""

    status = 503


@dataclass
class ApiRequest:
    """One API request as its handler and its turn need it: translated to template messages by the API's
    `*_request` function, then hashed, rendered and held to the context (`slime.agent.requests.measure`).
    Small and picklable: it is what a prepare worker sends back (`slime.agent.prepare_pool`)."""

    route: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    params: dict[str, Any]  # the client's sampling knobs, validated
    hints: RequestHints
    model: str | None  # the model name the client asked for
    stream: bool
    extra: dict[str, Any] = field(default_factory=dict)  # what only its API reads (include_usage, custom tools...)
    hashes: list[str] = field(default_factory=list)
    tools_hash: str = ""
    text: str = ""  # the prompt rendered with the generation prompt
    ids: list[int] | None = None  # its token ids, when measuring it had to count them


@dataclass
class TurnResult:
    rid: str
    parsed: ParsedOutput
    finish_reason: str  # stop | length
    prompt_tokens: int
    completion_tokens: int
    engine_ms: float = 0.0  # how long the engine call took (0: answered from a recorded turn)

    def headers(self) -> dict[str, str]:
        """What a JSON answer carries besides its body: the engine's share of the latency, so a client (or a
        benchmark) can tell the gateway's own time from the engine's."""
        return {ENGINE_MS_HEADER: f"{self.engine_ms:.3f}"}


class TurnRunner(Protocol):
    """The gateway as an API handler sees it."""

    model_name: str

    def new_rid(self, s: Session) -> str: ...

    async def run_turn(self, s: Session, req: ApiRequest, rid: str | None = None) -> TurnResult: ...

    async def count_tokens(self, req: ApiRequest) -> int: ...


Handler = Callable[[TurnRunner, web.Request, Session, ApiRequest], Awaitable[web.StreamResponse]]


# ---- request bodies ------------------------------------------------------------------------------------


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object that every later step can handle: no NaN or infinities, strings that
    encode to UTF-8 (a JSON `\\ud800` escape decodes to a lone surrogate, which the tokenizer and the hashes
    cannot take), and at most `MAX_JSON_DEPTH` levels of nesting."""
    try:
        body = json.loads(raw, parse_constant=_no_constant, parse_float=_finite_float)
    except RecursionError as e:
        raise BadRequest(f"body: nested deeper than {MAX_JSON_DEPTH} levels") from e
    except (ValueError, UnicodeDecodeError) as e:  # not JSON; also an integer literal over Python's digit limit
        raise BadRequest(f"body: invalid JSON ({e})") from e
    if not isinstance(body, dict):
        raise BadRequest("body: must be a JSON object")
    _check_tree(body)
    return body


def _no_constant(name: str) -> Any:
    raise BadRequest(f"body: {name} is not a JSON number")


def _finite_float(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise BadRequest(f"body: {text[:20]} is out of range")
    return v


def _check_tree(body: dict[str, Any]) -> None:
    """Depth and string checks without recursion (a hostile body must not exhaust the stack)."""
    stack: list[tuple[Any, int, Any]] = [(body, 0, None)]  # (value, depth, where: (parent where, key) | None)
    while stack:
        v, depth, where = stack.pop()
        if isinstance(v, str):
            if _SURROGATE.search(v):
                raise BadRequest(f"{_where(where)}: not valid Unicode (a lone surrogate)")
        elif isinstance(v, (dict, list)):
            if depth >= MAX_JSON_DEPTH:
                raise BadRequest(f"{_where(where)}: nested deeper than {MAX_JSON_DEPTH} levels")
            items = v.items() if isinstance(v, dict) else enumerate(v)
            for k, x in items:
                if isinstance(k, str) and _SURROGATE.search(k):
                    raise BadRequest(f"{_where(where)}: a key is not valid Unicode (a lone surrogate)")
                stack.append((x, depth + 1, (where, k)))


def _where(where: Any) -> str:
    """`messages[0].content` from the linked (parent, key) pairs `_check_tree` keeps."""
    keys = []
    while where is not None:
        where, k = where
        keys.append(k)
    out = ""
    for k in reversed(keys):
        out += f"[{k}]" if isinstance(k, int) else (f".{k}" if out else str(k))
    return out or "body"


# ---- sampling knobs ------------------------------------------------------------------------------------


def _int_field(body: dict[str, Any], name: str) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise BadRequest(f"{name}: must be a positive integer")
    return v


def _num_field(body: dict[str, Any], name: str) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise BadRequest(f"{name}: must be a number")
    try:
        return float(v)
    except OverflowError as e:
        raise BadRequest(f"{name}: out of range") from e


def _stop_field(body: dict[str, Any], name: str) -> list[str] | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, str):
        return [v]
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise BadRequest(f"{name}: must be a string or a list of strings")
    return v


def _knobs(body: dict[str, Any], out: dict[str, Any]) -> dict[str, Any]:
    """temperature, top_p, top_k within what SGLang accepts (an engine 500 would reach the client as 502)."""
    if (v := _num_field(body, "temperature")) is not None:
        if v < 0:
            raise BadRequest("temperature: must be >= 0")
        out["temperature"] = v
    if (v := _num_field(body, "top_p")) is not None:
        if not 0 < v <= 1:
            raise BadRequest("top_p: must be in (0, 1]")
        out["top_p"] = v
    if (v := _num_field(body, "top_k")) is not None:
        if not v.is_integer():
            raise BadRequest("top_k: must be an integer")
        out["top_k"] = -1 if v < 1 else min(int(v), TOP_K_ALL)  # < 1: no top-k, as the OpenAI-style servers read it
    return out


def request_params(body: dict[str, Any], *, max_tokens: str, stop: str) -> dict[str, Any]:
    """Client sampling knobs, validated; the session's own defaults win over them later."""
    out: dict[str, Any] = {}
    if (v := _int_field(body, max_tokens)) is not None:
        out["max_new_tokens"] = v
    if max_tokens != "max_completion_tokens" and (v := _int_field(body, "max_completion_tokens")) is not None:
        out["max_new_tokens"] = v
    _knobs(body, out)
    if (v := _stop_field(body, stop)) is not None:
        out["stop"] = v
    return out


def sampling_defaults(value: Any) -> dict[str, Any]:
    """A session's sampling defaults (admin API): the knobs the gateway itself computes with are checked,
    the rest goes to the engine as given (the engine answers 4xx for what it does not accept)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise BadRequest("sampling_defaults: must be an object")
    out = dict(value)
    checked: dict[str, Any] = {}
    try:
        _int_field(value, "max_new_tokens")
        _knobs(value, checked)
        _stop_field(value, "stop")
    except BadRequest as e:
        raise BadRequest(f"sampling_defaults.{e}", e.status) from e
    out.update(checked)
    return out


# ---- errors --------------------------------------------------------------------------------------------


def public_error(e: BaseException) -> tuple[int, str]:
    """(status, message) a client may see for `e`: the errors the gateway raises on purpose say what went
    wrong in words safe to show (never the engine's address, never a credential); anything else is ours."""
    if isinstance(e, (BadRequest, EngineError, StoreError, Unavailable)):
        return e.status, str(e)
    return 500, "internal error of the gateway (details are in its log)"


def error_body(api: str, status: int, message: str) -> dict[str, Any]:
    """The error object in the API's own shape (also the payload of an in-band SSE `error` event)."""
    if api == ANTHROPIC:
        kind = _ANTHROPIC_KINDS.get(status, "api_error" if status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": message}}
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return {"error": {"message": message, "type": kind, "code": status}}  # OpenAI's shape; the admin API's too


def error_response(api: str, status: int, message: str) -> web.Response:
    return web.json_response(error_body(api, status, message), status=status)


# ---- server-sent events --------------------------------------------------------------------------------


async def open_sse(request: web.Request) -> web.StreamResponse:
    """Start the event stream. Sent before the engine is called, so a client that drops the stream cancels
    (and aborts) the generation; from here on an error can only be reported in-band (`sse_of`)."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    request[_SSE] = resp
    return resp


def sse_of(request: web.Request) -> web.StreamResponse | None:
    """The request's event stream, once `open_sse` started it."""
    return request.get(_SSE)


async def send(resp: web.StreamResponse, data: dict[str, Any] | str, event: str | None = None) -> None:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    head = f"event: {event}\n" if event else ""
    await resp.write(f"{head}data: {payload}\n\n".encode())
