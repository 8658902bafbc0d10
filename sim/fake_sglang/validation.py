"""Request bodies of the fake server, read and refused the way SGLang 0.5.23 reads and refuses them.

Why: a client bug (a body that is not JSON, a string where a list of ints belongs, a missing field) must fail
against the fake where and how it fails against SGLang — same status, same error body — so that slime's error
handling is exercised against real answers, and a client's mistake never turns into a 500 of the fake.

What SGLang does (python/sglang/srt/entrypoints/http_server.py): every native endpoint takes one request class of
python/sglang/srt/managers/io_struct.py as its FastAPI body. FastAPI reads the body as JSON only under an
``application/json`` (or ``+json``) content type; any other body reaches validation as raw bytes, an empty body as
"missing". pydantic then validates in lax mode: integers from ``"5"``, ``5.0`` or ``true``; booleans from
``"true"``, ``"yes"``, ``1``; strings strictly; unknown keys ignored. A failure is `RequestValidationError`, which
http_server.py `validation_exception_handler` answers with 400 and the `ErrorResponse` shape of
python/sglang/srt/entrypoints/openai/protocol.py: ``{"object": "error", "message", "type": "Bad Request",
"param": null, "code": 400}``. A body that JSON cannot decode for another reason (nesting deeper than the recursion
limit, bytes that are not UTF-8) is FastAPI's ``HTTPException(400, "There was an error parsing the body")``, which
SGLang's HTTPException handler renders as the same shape with ``"type": "400"``. Unknown routes and methods keep
FastAPI's own answers: 404 ``{"detail": "Not Found"}``, 405 ``{"detail": "Method Not Allowed"}``.

The checks here are this module's own lax-mode rules, not pydantic; messages follow pydantic's wording.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import reprlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from sim.fake_sglang.protocol import has_lone_surrogate

MISSING: Any = object()  # an empty request body
Check = Callable[[Any, tuple], Any]

_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother, _SHORT.maxlist, _SHORT.maxdict = 3, 80, 80, 6, 6


def short_repr(x: Any) -> str:
    """A bounded repr: client input may be nested deeper than repr or json.dumps can recurse."""
    return _SHORT.repr(x)


def _bounded(x: Any) -> Any:
    """An error's `input` as pydantic shows it, cut short: scalars as they are, containers as a bounded repr."""
    if isinstance(x, str):
        return x if len(x) <= 80 else x[:77] + "..."
    if x is None or isinstance(x, bool | float) or (isinstance(x, int) and abs(x) < 10**80):
        return x
    return _SHORT.repr(x)


class RequestError(Exception):
    """A client error with the exact response SGLang gives for it; handlers and middleware return `.response`."""

    def __init__(self, response: web.Response) -> None:
        super().__init__(response.text)
        self.response = response


class Invalid(Exception):
    """pydantic-style validation errors (each a dict: type, loc, msg, input)."""

    def __init__(self, errors: list[dict[str, Any]]) -> None:
        super().__init__(errors)
        self.errors = errors


# ---- the answers ------------------------------------------------------------------------------------------
def validation_error(errors: list[dict[str, Any]]) -> web.Response:
    """http_server.py `validation_exception_handler`: 400, message = str(exc) + " " + str(exc.errors())."""
    shown = [{k: (_bounded(v) if k == "input" else v) for k, v in e.items()} for e in errors]
    n = len(shown)
    text = f"{n} validation error{'s' if n != 1 else ''}:\n" + "".join(f"  {e}\n" for e in shown)
    body = {"object": "error", "message": f"{text.rstrip()} {shown}", "type": "Bad Request", "param": None}
    return web.json_response({**body, "code": 400}, status=400)


def http_exception(status: int, detail: str) -> web.Response:
    """http_server.py's HTTPException handler: ErrorResponse with type = str(status)."""
    body = {"object": "error", "message": detail, "type": str(status), "param": None, "code": status}
    return web.json_response(body, status=status)


def error_message(message: str, status: int = 400) -> web.Response:
    """http_server.py `_create_error_response`: a ValueError raised while serving the request."""
    return web.json_response({"error": {"message": message}}, status=status)


def contract_error(message: str) -> web.Response:
    """http_server.py `generate_request`: a `/generate` body that breaks the JSON contract (contract.py)."""
    return web.json_response({"error": message}, status=400)


def internal_server_error() -> web.Response:
    """An exception SGLang does not catch: Starlette's ServerErrorMiddleware answers 500 in plain text."""
    return web.Response(text="Internal Server Error", status=500)


class UntypedResponse(web.Response):
    """Starlette's `Response(content=str)` without a media type sends no Content-Type; aiohttp would add
    application/octet-stream to a body without one (web_response.py `_prepare_headers`)."""

    async def _prepare_headers(self) -> None:
        await super()._prepare_headers()
        self.headers.popall("Content-Type", None)


def untyped_text(text: str, status: int = 200) -> web.Response:
    return UntypedResponse(body=text.encode(), status=status)


def route_error(status: int) -> web.Response | None:
    """FastAPI's default answer for an unknown route (404) or method (405); None for other statuses."""
    detail = {404: "Not Found", 405: "Method Not Allowed"}.get(status)
    return None if detail is None else web.json_response({"detail": detail}, status=status)


# ---- reading the body -------------------------------------------------------------------------------------
def _is_json_type(content_type: str | None) -> bool:
    if not content_type:
        return False  # FastAPI's strict_content_type (default): no header, no JSON
    media = content_type.split(";", 1)[0].strip().lower()
    main, _, sub = media.partition("/")
    return main == "application" and (sub == "json" or sub.endswith("+json"))


def parse_body(raw: bytes, content_type: str | None) -> Any:
    """FastAPI's body read: MISSING when empty, the bytes themselves unless JSON, else the decoded JSON."""
    if not raw:
        return MISSING
    if not _is_json_type(content_type):
        return raw
    try:
        return json.loads(raw)
    except json.JSONDecodeError as e:
        err = {"type": "json_invalid", "loc": ("body", e.pos), "msg": "JSON decode error", "input": {}}
        raise RequestError(validation_error([{**err, "ctx": {"error": e.msg}}])) from e
    except (ValueError, RecursionError) as e:  # not UTF-8, or nested past the recursion limit
        raise RequestError(http_exception(400, "There was an error parsing the body")) from e


async def read_body(request: web.Request) -> Any:
    return parse_body(await request.read(), request.headers.get("Content-Type"))


# ---- lax-mode checks (pydantic's Python-input rules) --------------------------------------------------------
def _fail(kind: str, loc: tuple, msg: str, value: Any) -> Invalid:
    return Invalid([{"type": kind, "loc": loc, "msg": msg, "input": value}])


def lax_str(v: Any, loc: tuple) -> str:
    if isinstance(v, str):
        return v
    raise _fail("string_type", loc, "Input should be a valid string", v)


def lax_int(v: Any, loc: tuple) -> int:
    if isinstance(v, bool | int):
        return int(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise _fail("finite_number", loc, "Input should be a finite number", v)
        if v != int(v):
            raise _fail(
                "int_from_float", loc, "Input should be a valid integer, got a number with a fractional part", v
            )
        return int(v)
    if isinstance(v, str):
        try:
            return int(v.strip())
        except ValueError:
            raise _fail(
                "int_parsing", loc, "Input should be a valid integer, unable to parse string as an integer", v
            ) from None
    raise _fail("int_type", loc, "Input should be a valid integer", v)


_TRUE = {"1", "on", "t", "true", "y", "yes"}
_FALSE = {"0", "off", "f", "false", "n", "no"}


def lax_bool(v: Any, loc: tuple) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, int | float) and v in (0, 1):
        return bool(v)
    if isinstance(v, str) and v.strip().lower() in _TRUE | _FALSE:
        return v.strip().lower() in _TRUE
    if isinstance(v, int | float | str):
        raise _fail("bool_parsing", loc, "Input should be a valid boolean, unable to interpret input", v)
    raise _fail("bool_type", loc, "Input should be a valid boolean", v)


def lax_float(v: Any, loc: tuple) -> float:
    if isinstance(v, bool | int | float):
        return float(v)
    if isinstance(v, str):
        try:
            return float(v.strip())
        except ValueError:
            raise _fail(
                "float_parsing", loc, "Input should be a valid number, unable to parse string as a number", v
            ) from None
    raise _fail("float_type", loc, "Input should be a valid number", v)


def any_dict(v: Any, loc: tuple) -> dict:
    if isinstance(v, dict):
        return v
    raise _fail("dict_type", loc, "Input should be a valid dictionary", v)


def optional(check: Check) -> Check:
    return lambda v, loc: None if v is None else check(v, loc)


def list_of(check: Check) -> Check:
    def run(v: Any, loc: tuple) -> list:
        if not isinstance(v, list):
            raise _fail("list_type", loc, "Input should be a valid list", v)
        out, errors = [], []
        for i, item in enumerate(v):
            try:
                out.append(check(item, (*loc, i)))
            except Invalid as e:
                errors += e.errors
        if errors:
            raise Invalid(errors)
        return out

    return run


def union(*arms: tuple[str, Check]) -> Check:
    """pydantic's smart union: the first arm that accepts wins; otherwise every arm's errors, located by arm."""

    def run(v: Any, loc: tuple) -> Any:
        errors = []
        for name, check in arms:
            try:
                return check(v, (*loc, name))
            except Invalid as e:
                errors += e.errors
        raise Invalid(errors)

    return run


def literal(*values: str) -> Check:
    expected = " or ".join(", ".join(f"'{x}'" for x in values).rsplit(", ", 1))

    def run(v: Any, loc: tuple) -> str:
        if isinstance(v, str) and v in values:
            return v
        raise _fail("literal_error", loc, f"Input should be {expected}", v)

    return run


def base64_bytes(v: Any, loc: tuple) -> bytes:
    """io_struct.py `Annotated[bytes, Base64Bytes()]` (python/sglang/srt/utils/msgspec_utils.py): strict base64."""
    if not isinstance(v, str):
        raise _fail("bytes_type", loc, "Input should be a valid bytes", v)
    try:
        return base64.b64decode(v, validate=True)
    except binascii.Error:
        raise _fail("value_error", loc, "Value error, Expected base64-encoded bytes", v) from None
    except ValueError as e:  # not ASCII
        raise _fail("value_error", loc, f"Value error, {e}", v) from None


def token_ids(v: Any, loc: tuple) -> Any:
    """python/sglang/srt/utils/field_validators.py `validate_optional_list_i64_1d_2d`: ints, or lists of ints."""

    def row(r: list, prefix: str) -> None:
        for x in r:
            if not isinstance(x, int):
                raise _fail("value_error", loc, f"Value error, {prefix}contains non-int64 element: {type(x)}", v)
            if not -(2**63) <= x < 2**63:
                raise _fail("value_error", loc, f"Value error, {prefix}contains non-int64 element: too big", v)

    if v is None:
        return None
    if not isinstance(v, list):
        raise _fail("value_error", loc, f"Value error, must be list or null; got {type(v).__name__}", v)
    if v and isinstance(v[0], int):
        row(v, "")
    elif v and isinstance(v[0], list):
        for i, r in enumerate(v):
            if not isinstance(r, list):
                raise _fail("value_error", loc, f"Value error, row {i}: must be a list; got {type(r).__name__}", v)
            row(r, f"row {i}: ")
    elif v:
        raise _fail("value_error", loc, f"Value error, elements must be int or list; got {type(v[0]).__name__}", v)
    return v


# ---- request classes ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Field:
    check: Check
    required: bool = False
    default: Any = None


@dataclass(frozen=True)
class Model:
    """One io_struct.py request class: `dataclass` ones (GenerateReqInput) and msgspec structs differ in the
    error a non-object body gets, and only dataclasses refuse keys that are not text."""

    name: str
    fields: dict[str, Field]
    dataclass: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def validate(self, body: Any, *, required: bool = True) -> dict[str, Any] | None:
        """The validated fields (defaults filled in, unknown keys dropped); raises RequestError with SGLang's 400."""
        try:
            return self._validate(body, required)
        except Invalid as e:
            raise RequestError(validation_error(e.errors)) from None

    def _validate(self, body: Any, required: bool) -> dict[str, Any] | None:
        if body is MISSING or (body is None and not required):  # FastAPI: an optional body may be null
            if required:
                raise _fail("missing", ("body",), "Field required", None)
            return None
        if not isinstance(body, dict):
            if self.dataclass:
                raise _fail(
                    "dataclass_type", ("body",), f"Input should be a dictionary or an instance of {self.name}", body
                )
            raise _fail("dict_type", ("body",), "Input should be a valid dictionary", body)
        errors: list[dict[str, Any]] = []
        if self.dataclass:
            for k in body:
                if has_lone_surrogate(k):
                    msg = "Input should be a valid string, unable to parse raw data as a unicode string"
                    errors.append({"type": "string_unicode", "loc": ("body",), "msg": msg, "input": k})
        out: dict[str, Any] = {}
        for name, f in self.fields.items():
            if name not in body:
                if f.required:
                    errors.append({"type": "missing", "loc": ("body", name), "msg": "Field required", "input": body})
                out[name] = f.default
                continue
            try:
                out[name] = f.check(body[name], ("body", name))
            except Invalid as e:
                errors += e.errors
        if errors:
            raise Invalid(errors)
        return out


def _req(name: str, **fields: Field) -> Model:
    # io_struct.py BaseReq: every request struct also carries rid and http_worker_ipc
    base = {"rid": Field(optional(lax_str)), "http_worker_ipc": Field(optional(lax_str))}
    return Model(name, {**base, **fields})


_SELECTOR = Field(literal("target", "draft", "all"), default="all")
_OPT_STR = Field(optional(lax_str))
_OPT_STR_LIST = Field(optional(list_of(lax_str)))


def _or_list(name: str, check: Check, item: Check | None = None) -> Check:
    item = item or check
    return optional(union((f"list[{name}]", list_of(item)), (name, check)))


# The fields of io_struct.py's request classes that the fake reads (or that a client commonly sends).
GENERATE = Model(
    "GenerateReqInput",
    {
        "text": Field(_or_list("str", lax_str)),
        "input_ids": Field(token_ids),
        "sampling_params": Field(_or_list("dict[str,any]", any_dict)),
        "rid": Field(_or_list("str", lax_str)),
        "return_logprob": Field(_or_list("bool", lax_bool)),
        "logprob_start_len": Field(_or_list("int", lax_int)),
        "top_logprobs_num": Field(_or_list("int", lax_int)),
        "return_text_in_logprobs": Field(lax_bool, default=False),
        "stream": Field(lax_bool, default=False),
        "log_metrics": Field(lax_bool, default=True),
        "bootstrap_host": Field(_or_list("str", lax_str, optional(lax_str))),
        "bootstrap_port": Field(_or_list("int", lax_int, optional(lax_int))),
        "bootstrap_room": Field(_or_list("int", lax_int, optional(lax_int))),
        "routed_dp_rank": Field(optional(lax_int)),
        "priority": Field(optional(lax_int)),
        "routing_key": _OPT_STR,
        "session_id": _OPT_STR,
        "extra_key": Field(_or_list("str", lax_str)),
    },
    dataclass=True,
)
ABORT = _req("AbortReq", abort_all=Field(lax_bool, default=False), abort_message=_OPT_STR)
PAUSE = _req("PauseGenerationReqInput", mode=Field(literal("abort", "retract", "in_place"), default="abort"))
CONTINUE = _req("ContinueGenerationReqInput", torch_empty_cache=Field(lax_bool, default=True))
UPDATE_FROM_TENSOR = _req(
    "UpdateWeightsFromTensorReqInput",
    serialized_named_tensors=Field(list_of(base64_bytes), required=True),
    load_format=_OPT_STR,
    flush_cache=Field(lax_bool, default=True),
    abort_all_requests=Field(lax_bool, default=False),
    weight_version=_OPT_STR,
    selector=_SELECTOR,
    torch_empty_cache=Field(lax_bool, default=False),
)
UPDATE_FROM_DISK = _req(
    "UpdateWeightFromDiskReqInput",
    model_path=Field(lax_str, required=True),
    load_format=_OPT_STR,
    abort_all_requests=Field(lax_bool, default=False),
    weight_version=_OPT_STR,
    is_async=Field(lax_bool, default=False),
    torch_empty_cache=Field(lax_bool, default=False),
    keep_pause=Field(lax_bool, default=False),
    recapture_cuda_graph=Field(lax_bool, default=False),
    token_step=Field(lax_int, default=0),
    flush_cache=Field(lax_bool, default=True),
    manifest=Field(optional(any_dict)),
)
UPDATE_WEIGHT_VERSION = _req(
    "UpdateWeightVersionReqInput",
    new_version=Field(lax_str, required=True),
    abort_all_requests=Field(lax_bool, default=True),
)
INIT_GROUP = _req(
    "InitWeightsUpdateGroupReqInput",
    master_address=Field(lax_str, required=True),
    master_port=Field(lax_int, required=True),
    rank_offset=Field(lax_int, required=True),
    world_size=Field(lax_int, required=True),
    group_name=Field(lax_str, default="weight_update_group"),
    backend=Field(lax_str, default="nccl"),
)
DESTROY_GROUP = _req("DestroyWeightsUpdateGroupReqInput", group_name=Field(lax_str, default="weight_update_group"))
UPDATE_FROM_DISTRIBUTED = _req(
    "UpdateWeightsFromDistributedReqInput",
    names=Field(list_of(lax_str), required=True),
    dtypes=Field(list_of(lax_str), required=True),
    shapes=Field(list_of(list_of(lax_int)), required=True),
    group_name=Field(lax_str, default="weight_update_group"),
    flush_cache=Field(lax_bool, default=True),
    abort_all_requests=Field(lax_bool, default=False),
    weight_version=_OPT_STR,
    load_format=_OPT_STR,
    selector=_SELECTOR,
    torch_empty_cache=Field(lax_bool, default=False),
)
BEGIN_UPDATE = _req("BeginWeightUpdateReqInput", selector=_SELECTOR)
END_UPDATE = _req("EndWeightUpdateReqInput")
RELEASE_MEMORY = _req("ReleaseMemoryOccupationReqInput", tags=_OPT_STR_LIST)
RESUME_MEMORY = _req("ResumeMemoryOccupationReqInput", tags=_OPT_STR_LIST)
GET_WEIGHTS_BY_NAME = Model(
    "GetWeightsByNameReqInput",
    {
        "rid": Field(optional(lax_str)),
        "http_worker_ipc": Field(optional(lax_str)),
        "name": Field(lax_str, required=True),
        "truncate_size": Field(lax_int, default=100),
    },
)
CHECK_WEIGHTS = _req(
    "CheckWeightsReqInput",
    action=Field(lax_str, default="checksum"),
    allow_quant_error=Field(lax_bool, default=False),
    skip_tensor_list=_OPT_STR_LIST,
    selector=_SELECTOR,
)


def non_negative_float_query(request: web.Request, name: str, default: float) -> float:
    """A `Query(default, ge=0.0)` parameter (http_server.py `flush_cache(timeout)`)."""
    raw = request.query.get(name)
    if raw is None:
        return default
    loc = ("query", name)
    try:
        value = lax_float(raw, loc)
        if not value >= 0:
            raise _fail("greater_than_equal", loc, "Input should be greater than or equal to 0", raw)
    except Invalid as e:
        raise RequestError(validation_error(e.errors)) from None
    return value
