"""The gateway's request-side checks and error shapes, without a server: body reading (depth, surrogates,
non-finite numbers), sampling knobs, error bodies per API, engine-address redaction, key masking."""

from __future__ import annotations

import json

import pytest

from slime.agent.api import (
    ANTHROPIC,
    MAX_JSON_DEPTH,
    OPENAI,
    TOP_K_ALL,
    error_body,
    parse_json_body,
    public_error,
    request_params,
    sampling_defaults,
)
from slime.agent.engine_client import EngineError, redact_hosts
from slime.agent.gateway_http import api_of, masked, same_secret
from slime.agent.messages import BadRequest
from slime.agent.stores import StoreError, id_shaped, new_credentials

pytestmark = pytest.mark.cpu


def test_json_body_accepts_real_bodies() -> None:
    body = {"messages": [{"role": "user", "content": "héllo 😀 \u2028"}], "n": [1.5, -2, None, True]}
    assert parse_json_body(json.dumps(body).encode()) == body
    assert parse_json_body(json.dumps(body, ensure_ascii=False).encode()) == body
    nested: dict = {"x": 0}
    for _ in range(MAX_JSON_DEPTH - 1):
        nested = {"x": nested}
    assert parse_json_body(json.dumps(nested).encode()) == nested  # exactly at the limit


@pytest.mark.parametrize(
    "raw,says",
    [
        (b'{"a": ' + b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1) + b"}", "a" + "[0]" * 99),
        (b"[" * 100_000 + b"]" * 100_000, "body: nested deeper"),  # past the parser's own recursion limit
        (b'{"messages": [{"content": "a\\ud800b"}]}', "messages[0].content: not valid Unicode"),
        (b'{"tools": [{"\\udfff": 1}]}', "tools[0]: a key is not valid Unicode"),
        (b'{"s": "\xed\xa0\x80"}', "s: not valid Unicode"),  # the same surrogate as raw bytes
        (b'{"temperature": NaN}', "NaN is not a JSON number"),
        (b'{"temperature": -Infinity}', "-Infinity is not a JSON number"),
        (b'{"temperature": 1e999}', "out of range"),
        (b'{"max_tokens": ' + b"9" * 5000 + b"}", "invalid JSON"),
        (b"\xff\xfe", "invalid JSON"),
        (b"[1]", "must be a JSON object"),
    ],
)
def test_json_body_refuses_what_later_steps_cannot_take(raw: bytes, says: str) -> None:
    with pytest.raises(BadRequest) as e:
        parse_json_body(raw)
    assert e.value.status == 400 and says in str(e.value), str(e.value)


def test_sampling_knobs() -> None:
    p = request_params(
        {"max_tokens": 5, "temperature": 0, "top_p": 1, "top_k": 0, "stop": "x"}, max_tokens="max_tokens", stop="stop"
    )
    assert p == {"max_new_tokens": 5, "temperature": 0.0, "top_p": 1.0, "top_k": -1, "stop": ["x"]}
    assert request_params({"top_k": 10**40}, max_tokens="max_tokens", stop="stop")["top_k"] == TOP_K_ALL
    for bad in (
        {"temperature": -0.1},
        {"temperature": "hot"},
        {"temperature": 10**400},
        {"top_p": 0},
        {"top_p": 1.01},
        {"top_k": 2.5},
        {"max_tokens": 0},
        {"max_tokens": True},
        {"stop": [1]},
    ):
        with pytest.raises(BadRequest) as e:
            request_params(bad, max_tokens="max_tokens", stop="stop")
        assert next(iter(bad)) in str(e.value)
    assert sampling_defaults(None) == {}
    assert sampling_defaults({"max_new_tokens": 9, "top_k": 0, "foo": 1}) == {
        "max_new_tokens": 9,
        "top_k": -1,
        "foo": 1,
    }
    with pytest.raises(BadRequest, match="sampling_defaults.max_new_tokens"):
        sampling_defaults({"max_new_tokens": "many"})
    with pytest.raises(BadRequest, match="sampling_defaults: must be an object"):
        sampling_defaults([1])


def test_error_shapes_and_public_messages() -> None:
    assert error_body(OPENAI, 400, "m") == {"error": {"message": "m", "type": "invalid_request_error", "code": 400}}
    assert error_body(OPENAI, 502, "m")["error"]["type"] == "server_error"
    assert error_body(ANTHROPIC, 401, "m") == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "m"},
    }
    assert error_body(ANTHROPIC, 409, "m")["error"]["type"] == "invalid_request_error"
    assert error_body(ANTHROPIC, 503, "m")["error"]["type"] == "api_error"
    assert public_error(BadRequest("x: y", 409)) == (409, "x: y")
    assert public_error(StoreError("lock lost")) == (503, "lock lost")
    e = EngineError("the engine could not be reached", 502, "http://10.0.0.7:30000/generate: refused")
    assert public_error(e) == (502, "the engine could not be reached") and "10.0.0.7" in e.detail
    status, msg = public_error(KeyError("http://10.0.0.7:30000"))
    assert status == 500 and "10.0.0.7" not in msg


def test_engine_addresses_are_redacted() -> None:
    text = "too long at http://10.0.0.7:30000/generate, worker 127.0.0.1:31001 and [::1]:8000; see localhost:1"
    out = redact_hosts(text)
    assert not any(s in out for s in ("10.0.0.7", "30000", "31001", "::1", "8000", "localhost")), out
    assert out.startswith("too long at <engine>")
    assert redact_hosts("prompt has 5000 tokens, limit 4096") == "prompt has 5000 tokens, limit 4096"


def test_paths_keys_and_ids() -> None:
    sid, key = new_credentials()
    assert id_shaped(sid) and id_shaped(key)
    assert not any(id_shaped(x) for x in ("", "a/b", "127.0.0.1:80", "\ud800", "é", "x" * 129))
    assert masked(f"/s/{key}/v1/messages") == "/s/***/v1/messages" and masked(f"/s/{key}") == "/s/***"
    assert masked("/v1/messages") == "/v1/messages"
    assert api_of("/s/k/v1/messages") == api_of("/messages/count_tokens") == ANTHROPIC
    assert api_of("/v1/chat/completions") == api_of("/v1/messages_x") == OPENAI
    assert api_of("/admin/sessions/x") == "admin"
    assert same_secret(key, key) and not same_secret(key + "x", key)
    assert not same_secret(None, key) and not same_secret(key, None) and not same_secret("\udc80", key)
