"""The JSON contract SGLang 0.5.22+ checks a `/generate` body against after FastAPI has parsed it, and what the
releases before it fail on instead (`sampling_type_error`).

Why a second check: python/sglang/srt/entrypoints/http_server.py `generate_request` runs `generate_contract_error`
(python/sglang/srt/entrypoints/api_contract.py) on the raw JSON, which decodes it with the generated schema types of
python/sglang/api/v1/api_types.py and answers any violation with 400 ``{"error": "<text>"}``. It is stricter than
pydantic's lax parse before it — no ``"5"`` for an integer, no ``1`` for a boolean — and it refuses sampling_params
keys outside SamplingParams (a typo such as ``max_tokens`` is an error, not a silent default). Messages are worded
as serde's (``invalid type: string "x", expected f64``), since the schema is shared with SGLang's Rust server.

Only the top-level fields the fake reads or that clients commonly send are checked; the others pass, as the real
contract ignores keys it does not know at the top level.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class ContractError(ValueError):
    pass


def _shown(v: Any) -> str:
    """serde's `Unexpected` display of a JSON value."""
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


def _wrong(v: Any, expected: str) -> ContractError:
    return ContractError(f"invalid type: {_shown(v)}, expected {expected}")


def _int(v: Any, expected: str = "i64") -> int:
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    raise _wrong(v, expected)


def _uint(v: Any) -> int:
    if _int(v, "u64") < 0:
        raise ContractError(f"invalid value: integer `{v}`, expected u64")
    return v


def _float(v: Any) -> float:
    if isinstance(v, int | float) and not isinstance(v, bool):
        return float(v)
    raise _wrong(v, "f64")


def _bool(v: Any, expected: str = "a boolean") -> bool:
    if isinstance(v, bool):
        return v
    raise _wrong(v, expected)


def _str(v: Any, expected: str = "a string") -> str:
    if isinstance(v, str):
        return v
    raise _wrong(v, expected)


def _seq(v: Any) -> list:
    if isinstance(v, list):
        return v
    raise _wrong(v, "a sequence")


def _map(v: Any, expected: str = "a map") -> dict:
    if isinstance(v, dict):
        return v
    raise _wrong(v, expected)


def _each(check: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda v: [check(x) for x in _seq(v)]


def _one_or_list(name: str, one: Callable[[Any], Any], item: Callable[[Any], Any] | None = None) -> Callable:
    """A `XOrList` schema type: one value, or a list of them (one per prompt of a batch)."""
    expected = f"a value or an array of values for {name}"

    def check(v: Any) -> Any:
        if isinstance(v, list):
            return _each(item or one)(v)
        try:
            return one(v)
        except ContractError:
            raise _wrong(v, expected) from None

    return check


def _nullable(check: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda v: None if v is None else check(v)


def _token_ids_or_list(v: Any) -> Any:
    # [] and [number, ...] are one prompt; anything else is a batch of prompts.
    if not isinstance(v, list):
        raise _wrong(v, "a value or an array of values for TokenIdsOrList")
    if not v or (isinstance(v[0], int | float) and not isinstance(v[0], bool)):
        return _each(_int)(v)
    return _each(_each(_int))(v)


_SAMPLING: dict[str, Callable[[Any], Any]] = {
    "max_new_tokens": _int, "stop": _one_or_list("StringOrList", _str), "stop_token_ids": _each(_int),
    "stop_regex": _one_or_list("StringOrList", _str), "temperature": _float, "top_p": _float, "top_k": _int,
    "min_p": _float, "frequency_penalty": _float, "presence_penalty": _float, "repetition_penalty": _float,
    "min_new_tokens": _int, "n": _int, "json_schema": _str, "regex": _str, "ebnf": _str, "structural_tag": _str,
    "ignore_eos": _bool, "skip_special_tokens": _bool, "spaces_between_special_tokens": _bool,
    "no_stop_trim": _bool, "stream_interval": _int, "logit_bias": lambda v: {k: _float(x) for k, x in _map(v).items()},
    "sampling_seed": _int, "custom_params": lambda v: v, "beam_width": _int,
    "watermark": lambda v: _map(v, "struct WatermarkRequestConfig"), "choice": _each(_str),
}  # fmt: skip


def _unknown(key: str) -> ContractError:
    listed = ", ".join(f"`{k}`" for k in _SAMPLING)
    return ContractError(f"unknown field `{key}`, expected one of {listed}")


def _sampling_params(v: Any, expected: str = "struct SamplingParams") -> dict:
    for key, x in _map(v, expected).items():
        check = _SAMPLING.get(key)
        if check is None:
            raise _unknown(key)
        if x is not None:
            check(x)
    return v


def _sampling_params_or_list(v: Any) -> Any:
    if isinstance(v, list):
        return _each(_sampling_params)(v)
    return _sampling_params(v, "a value or an array of values for SamplingParamsOrList")


_NULLABLE_INT = _nullable(_int)
_NULLABLE_STR = _nullable(_str)
_GENERATE: dict[str, Callable[[Any], Any]] = {
    "rid": _one_or_list("StringOrList", _str), "text": _one_or_list("StringOrList", _str),
    "input_ids": _token_ids_or_list, "stream": _bool, "sampling_params": _sampling_params_or_list,
    "return_logprob": _one_or_list("BoolOrList", _bool), "logprob_start_len": _one_or_list("Int64OrList", _int),
    "top_logprobs_num": _one_or_list("Int64OrList", _int), "token_ids_logprob": _token_ids_or_list,
    "return_hidden_states": _one_or_list("BoolOrList", _bool), "return_text_in_logprobs": _bool,
    "bootstrap_host": _one_or_list("OptionalStringOrList", _str, _NULLABLE_STR),
    "bootstrap_port": _one_or_list("OptionalInt64OrList", _int, _NULLABLE_INT),
    "bootstrap_room": _one_or_list("OptionalInt64OrList", _int, _NULLABLE_INT),
    "routed_dp_rank": _int, "priority": _int, "routing_key": _str, "max_thinking_tokens": _uint,
    "session_id": _str, "extra_key": _one_or_list("StringOrList", _str),
    "custom_labels": lambda v: {k: _str(x) for k, x in _map(v).items()},
}  # fmt: skip


def generate_contract_error(body: Any) -> str | None:
    """The contract violation of a parsed `/generate` body, in SGLang's words, or None."""
    try:
        for key, value in _map(body, "struct GenerateRequest").items():
            check = _GENERATE.get(key)
            if check is not None and value is not None:
                check(value)
    except ContractError as e:
        return str(e)
    return None


# ---- before the contract (0.5.14-0.5.21) ---------------------------------------------------------------------
# python/sglang/srt/sampling/sampling_params.py: the keyword arguments SamplingParams takes in 0.5.17 (0.5.19 adds
# beam_width, 0.5.20 ebnf_full_assistant). tokenizer_manager.py builds it as `SamplingParams(**sampling_params)`.
_SAMPLING_KWARGS_0517 = frozenset(
    "max_new_tokens stop stop_token_ids stop_regex temperature top_p top_k min_p frequency_penalty presence_penalty "
    "repetition_penalty min_new_tokens n json_schema regex ebnf structural_tag ignore_eos skip_special_tokens "
    "spaces_between_special_tokens no_stop_trim stream_interval logit_bias sampling_seed custom_params stop_strs "
    "stop_regex_strs stop_str_max_len stop_regex_max_len is_normalized".split()
)
# The ones SGLang compares or adds (`__post_init__`, `verify`, the context-length check): another type raises there.
_NUMERIC = ("max_new_tokens", "temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
            "repetition_penalty", "min_new_tokens", "n")  # fmt: skip


def sampling_type_error(body: Any, release: tuple[int, ...] = (0, 5, 17)) -> str | None:
    """What a release without the JSON contract fails on in `sampling_params` with a TypeError (nothing catches it:
    500 "Internal Server Error"): a keyword SamplingParams does not take, or a number that is not one. None if the
    params pass (other type mistakes go on to SGLang's own checks, or through)."""
    known = set(_SAMPLING_KWARGS_0517)
    if release >= (0, 5, 19):
        known.add("beam_width")
    if release >= (0, 5, 20):
        known.add("ebnf_full_assistant")
    params = body.get("sampling_params") if isinstance(body, dict) else None
    for sp in params if isinstance(params, list) else [params]:
        if not isinstance(sp, dict):
            continue
        for key, value in sp.items():
            if key not in known:
                return f"SamplingParams.__init__() got an unexpected keyword argument '{key}'"
            if key in _NUMERIC and value is not None and not isinstance(value, int | float):
                return f"'<' not supported between instances of '{type(value).__name__}' and 'int' ({key})"
    return None
