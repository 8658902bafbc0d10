"""Request bodies of the mock router, refused the way sglang-router 0.3.2 refuses them.

Why: the real router (Rust: axum's `Json` extractor over serde) refuses a malformed body before it picks a worker,
with plain-text answers a client sees instead of the engine's; the mock must give the same ones so that tests on
the mock see what they would see on the real router. Observed on the real 0.3.2 binary on loopback:

- content type not ``application/json`` (or ``+json``), or none: 415 ``Expected request with `Content-Type:
  application/json```;
- not JSON (syntax, NaN, a lone surrogate escape, an empty body, bytes that are not UTF-8): 400 ``Failed to parse
  the request body as JSON: <what> at line L column C``;
- JSON of the wrong shape (a list or string for an object, a missing required field, a wrong type, an integer out
  of range, a duplicate field): 422 ``Failed to deserialize the JSON body into the target type: <path>: <what> at
  line L column C``, worded by serde (``invalid type: string "x", expected f32``).

The mock gives the same status and wording; the "at line L column C" position it cannot compute as serde does, so
parse errors carry Python's position and type errors none. Unknown fields are ignored, as serde ignores them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from aiohttp import web

UNSUPPORTED_MEDIA = "Expected request with `Content-Type: application/json`"
PARSE_PREFIX = "Failed to parse the request body as JSON: "
DATA_PREFIX = "Failed to deserialize the JSON body into the target type: "


class Rejected(Exception):
    """The router's answer to a body it cannot take."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(text)
        self.response = web.Response(status=status, text=text, content_type="text/plain", charset="utf-8")


class _DataError(Exception):
    def __init__(self, path: str, message: str) -> None:
        super().__init__(message)
        self.path, self.message = path, message


# ---- serde's words --------------------------------------------------------------------------------------------
def _shown(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"boolean `{str(v).lower()}`"
    if isinstance(v, int):
        return f"integer `{v}`"
    if isinstance(v, float):
        return f"floating point `{v}`"
    if isinstance(v, str):
        return f'string "{v}"'
    return "sequence" if isinstance(v, list) else "map"


Decode = Callable[[Any, str], Any]


def _at(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def _type_error(v: Any, path: str, expected: str) -> _DataError:
    return _DataError(path, f"invalid type: {_shown(v)}, expected {expected}")


def string(v: Any, path: str) -> str:
    if isinstance(v, str):
        return v
    raise _type_error(v, path, "a string")


def boolean(v: Any, path: str) -> bool:
    if isinstance(v, bool):
        return v
    raise _type_error(v, path, "a boolean")


def integer(name: str, lo: int, hi: int) -> Decode:
    """A Rust integer type (i32, u16, ...): JSON integers in [lo, hi] only."""

    def run(v: Any, path: str) -> int:
        if not isinstance(v, int) or isinstance(v, bool):
            raise _type_error(v, path, name)
        if not lo <= v <= hi:
            raise _DataError(path, f"invalid value: integer `{v}`, expected {name}")
        return v

    return run


def f32(v: Any, path: str) -> float:
    if isinstance(v, int | float) and not isinstance(v, bool):
        return float(v)
    raise _type_error(v, path, "f32")


def mapping(v: Any, path: str) -> dict:
    if isinstance(v, dict):
        return v
    raise _type_error(v, path, "a map")


def anything(v: Any, path: str) -> Any:
    return v


def nullable(decode: Decode) -> Decode:
    return lambda v, path: None if v is None else decode(v, path)


def seq_of(decode: Decode) -> Decode:
    def run(v: Any, path: str) -> list:
        if not isinstance(v, list):
            raise _type_error(v, path, "a sequence")
        return [decode(x, _at(path, i)) for i, x in enumerate(v)]

    return run


def untagged(name: str, *variants: Decode) -> Decode:
    """serde's `#[serde(untagged)]` enum: the first variant that decodes; one error naming the enum otherwise."""

    def run(v: Any, path: str) -> Any:
        for variant in variants:
            try:
                return variant(v, path)
            except _DataError:
                continue
        raise _DataError(path, f"data did not match any variant of untagged enum {name}")

    return run


I32 = integer("i32", -(2**31), 2**31 - 1)
U16 = integer("u16", 0, 2**16 - 1)
U32 = integer("u32", 0, 2**32 - 1)
U64 = integer("u64", 0, 2**64 - 1)


class Struct:
    """A Rust struct deserialized by serde: fields in declaration order (a JSON array fills them in order)."""

    def __init__(self, name: str, fields: dict[str, Decode], required: tuple[str, ...] = ()) -> None:
        self.name, self.fields, self.required = name, fields, required

    def __call__(self, v: Any, path: str = "") -> dict:
        if isinstance(v, list):  # serde accepts a sequence for a struct: element i is field i
            names = list(self.fields)
            for i, x in enumerate(v[: len(names)]):
                self.fields[names[i]](x, _at(path, i))
            if len(v) < len(self.fields):
                raise _DataError(
                    path, f"invalid length {len(v)}, expected struct {self.name} with {len(names)} elements"
                )
            return {}
        if not isinstance(v, dict):
            raise _type_error(v, path, f"struct {self.name}")
        for key, x in v.items():
            decode = self.fields.get(key)
            if decode is not None:
                decode(x, _at(path, key))
        for key in self.required:
            if key not in v:
                raise _DataError(path, f"missing field `{key}`")
        return v


# ---- what the router reads (field types as the real 0.3.2 binary reports them) -------------------------------
_OPT_STR, _OPT_BOOL = nullable(string), nullable(boolean)
STRING_OR_ARRAY = untagged("StringOrArray", string, seq_of(string))
SAMPLING_PARAMS = Struct(
    "SamplingParams",
    {
        "temperature": nullable(f32), "max_new_tokens": nullable(U32), "top_p": nullable(f32),
        "top_k": nullable(I32), "frequency_penalty": nullable(f32), "presence_penalty": nullable(f32),
        "repetition_penalty": nullable(f32), "stop": nullable(STRING_OR_ARRAY), "ignore_eos": _OPT_BOOL,
        "skip_special_tokens": _OPT_BOOL, "json_schema": _OPT_STR, "regex": _OPT_STR, "ebnf": _OPT_STR,
        "min_p": nullable(f32), "min_new_tokens": nullable(U32), "stop_token_ids": nullable(seq_of(U32)),
        "no_stop_trim": _OPT_BOOL, "n": nullable(U32), "sampling_seed": nullable(U64),
    },
)  # fmt: skip
GENERATE_REQUEST = Struct(
    "GenerateRequest",
    {
        "text": _OPT_STR, "input_ids": nullable(untagged("InputIds", seq_of(I32), seq_of(seq_of(I32)))),
        "rid": _OPT_STR, "stream": _OPT_BOOL, "return_logprob": _OPT_BOOL, "return_text_in_logprobs": _OPT_BOOL,
        "sampling_params": nullable(SAMPLING_PARAMS), "logprob_start_len": nullable(I32),
        "top_logprobs_num": nullable(I32), "bootstrap_host": _OPT_STR, "bootstrap_port": nullable(I32),
        "bootstrap_room": nullable(I32), "lora_path": _OPT_STR, "priority": nullable(I32),
        "session_params": nullable(mapping),
    },
)  # fmt: skip
WORKER_CONFIG = Struct(
    "WorkerConfigRequest",
    {
        "url": string, "model_id": _OPT_STR, "priority": nullable(U32), "cost": nullable(f32),
        "worker_type": _OPT_STR, "bootstrap_port": nullable(U16), "tokenizer_path": _OPT_STR,
        "api_key": _OPT_STR, "runtime": _OPT_STR, "labels": nullable(mapping), "dp_aware": _OPT_BOOL,
    },
    required=("url",),
)  # fmt: skip


# ---- axum's Json extractor -----------------------------------------------------------------------------------
def _is_json(content_type: str | None) -> bool:
    media = (content_type or "").split(";", 1)[0].strip().lower()
    main, _, sub = media.partition("/")
    return main == "application" and (sub == "json" or sub.endswith("+json"))


def _no_constants(name: str) -> Any:
    raise ValueError(f"expected value ({name} is not JSON)")


def _duplicates_refused(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, x in pairs:
        if k in out:
            raise _DataError("", f"duplicate field `{k}`")
        out[k] = x
    return out


def _lone_surrogate_path(value: Any) -> str | None:
    """Where a string holds a lone surrogate escape (serde refuses those while parsing); iterative, any depth."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        v, path = stack.pop()
        items = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, list) else ()
        for k, x in items:
            if isinstance(k, str) and _bad(k):
                return path
            stack.append((x, _at(path, k)))
        if isinstance(v, str) and _bad(v):
            return path
    return None


def _bad(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _parse_error(message: str, path: str = "") -> Rejected:
    return Rejected(400, PARSE_PREFIX + (f"{path}: " if path else "") + message)


def decode_json(raw: bytes, content_type: str | None, target: Struct) -> dict[str, Any]:
    """The body as `target` would take it; Rejected with the router's status and text otherwise."""
    if not _is_json(content_type):
        raise Rejected(415, UNSUPPORTED_MEDIA)
    if not raw.strip():
        raise _parse_error("EOF while parsing a value at line 1 column 0")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _parse_error(f"invalid unicode code point at line 1 column {e.start + 1}") from None
    try:
        value = json.loads(text, parse_constant=_no_constants, object_pairs_hook=_duplicates_refused)
    except json.JSONDecodeError as e:
        words = {"Expecting value": "expected value", "Extra data": "trailing characters"}.get(e.msg, e.msg.lower())
        raise _parse_error(f"{words} at line {e.lineno} column {e.colno}") from None
    except _DataError as e:
        raise Rejected(422, DATA_PREFIX + e.message) from None
    except ValueError as e:  # NaN / Infinity
        raise _parse_error(str(e)) from None
    except RecursionError:
        if text.lstrip().startswith("["):  # serde stops at the first element: a sequence where field 0 belongs
            try:
                target([[]])
            except _DataError as e:
                raise Rejected(422, DATA_PREFIX + f"{e.path}: {e.message}") from None
        raise _parse_error("recursion limit exceeded") from None
    bad = _lone_surrogate_path(value)
    if bad is not None:
        raise _parse_error("unexpected end of hex escape", bad)
    try:
        target(value)
    except _DataError as e:
        raise Rejected(422, DATA_PREFIX + (f"{e.path}: " if e.path else "") + e.message) from None
    return value


def uuid_error(text: str) -> str | None:
    """The uuid crate's complaint about a worker id, or None when it is a UUID."""
    import uuid

    try:
        uuid.UUID(text)
        return None
    except ValueError:
        pass
    body = text.removeprefix("urn:uuid:")
    for i, ch in enumerate(body):
        if ch not in "0123456789abcdefABCDEF-{}":
            return (
                "invalid character: expected an optional prefix of `urn:uuid:` followed by [0-9a-fA-F-], "
                f"found `{ch}` at {i + 1}"
            )
    groups = body.strip("{}").split("-")
    if len(groups) == 1:
        return f"invalid length: expected length 32 for simple format, found {len(body)}"
    return f"invalid group count: expected 5, found {len(groups)}"
