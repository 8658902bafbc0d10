"""Hostile inputs never become a 5xx: one property per API the gateway serves (OpenAI chat completions, OpenAI
Responses, Anthropic messages + count_tokens, the admin API).

Each example takes a valid request and breaks one place of it: nesting far deeper than any client sends, a
lone surrogate in a string or a key (as a JSON escape or as raw bytes), NaN / Infinity / out-of-range
numbers, an integer literal past Python's digit limit, a random JSON value of the wrong type, sampling knobs
out of range, or bytes that are not JSON at all. The answer must be 4xx (200 only where the broken place
happens to be allowed), in the API's own error shape, never naming the engine's host:port, and the gateway
stays up. In-process gateway, `scripted` fake engine; 200 examples per API under CI=true (the "ci" profile
of tests/hypothesis_budget.py).
"""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sim.fake_sglang.testing import launch_fake_sglang
from slime.agent.api import MAX_JSON_DEPTH
from slime.agent.gateway import Gateway
from slime.utils.async_utils import run

pytestmark = pytest.mark.cpu

HOLE = "\x00hole\x00"  # stands where the broken fragment goes, replaced in the serialised body
BASES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {
        "model": "m",
        "messages": [
            {"role": "system", "content": "s"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        ],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        "max_tokens": 4,
    },
    "/v1/responses": {
        "model": "m",
        "instructions": "s",
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        "max_output_tokens": 4,
    },
    "/v1/messages": {
        "model": "m",
        "max_tokens": 4,
        "system": [{"type": "text", "text": "s"}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}],
    },
    "/admin/sessions": {"sampling_defaults": {"max_new_tokens": 4}, "max_context_tokens": 256, "metadata": {"i": 1}},
}
BASES["/v1/messages/count_tokens"] = BASES["/v1/messages"]
KNOBS = ["temperature", "top_p", "top_k", "max_tokens", "max_completion_tokens", "max_output_tokens", "stop"]


def paths(v: Any, at: tuple = ()) -> Iterator[tuple]:
    """Every place in a JSON value (containers and leaves)."""
    yield at
    items = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, list) else ()
    for k, x in items:
        yield from paths(x, (*at, k))


def put(body: Any, at: tuple, value: Any) -> Any:
    if not at:
        return value
    body = json.loads(json.dumps(body))
    node = body
    for k in at[:-1]:
        node = node[k]
    node[at[-1]] = value
    return body


json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**20), 10**20),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
)
json_any = st.recursive(
    json_leaf, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3), max_leaves=8
)
surrogate = st.integers(0xD800, 0xDFFF).map(lambda c: f"\\u{c:04x}")
deep = st.tuples(st.integers(MAX_JSON_DEPTH + 1, 20_000), st.sampled_from(["[]", "{}"])).map(
    lambda t: '{"a":' * t[0] + "0" + "}" * t[0] if t[1] == "{}" else "[" * t[0] + "]" * t[0]
)
# (raw JSON fragment, whether it must be refused while the body is read: 400 whatever the place)
fragments = st.one_of(
    deep.map(lambda f: (f, True)),
    surrogate.map(lambda s: (f'"a{s}b"', True)),
    surrogate.map(lambda s: (f'{{"{s}": 1}}', True)),
    st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999", "-4e400", "9" * 5000]).map(lambda f: (f, True)),
    json_any.map(lambda v: (json.dumps(v), False)),
)
knob_values = st.sampled_from([-1, -1e-9, 0, 0.5, 1.5, 2, 10**40, "8", True, [1], {"a": 1}, None, 1e308, -(10**40)])


@st.composite
def hostile_body(draw: st.DrawFn, endpoint: str) -> tuple[bytes, bool]:
    """(raw body, whether it must be refused as 400 by the body reader)."""
    base = BASES[endpoint]
    if endpoint != "/admin/sessions" and draw(st.booleans()):
        base = dict(base, stream=True)
    how = draw(st.sampled_from(["fragment", "fragment", "fragment", "knob", "raw-bytes", "not-json"]))
    if how == "knob":
        where = ("sampling_defaults", draw(st.sampled_from(KNOBS))) if endpoint == "/admin/sessions" else None
        body = put(base, where or (draw(st.sampled_from(KNOBS)),), draw(knob_values))
        return json.dumps(body).encode(), False
    if how == "raw-bytes":  # a lone surrogate as UTF-8 bytes (json.loads decodes bytes with surrogatepass)
        c = draw(st.integers(0xD800, 0xDFFF))
        raw = json.dumps(put(base, draw(st.sampled_from(list(paths(base))[1:])), HOLE)).encode()
        return raw.replace(json.dumps(HOLE).encode(), b'"' + chr(c).encode("utf-8", "surrogatepass") + b'"'), True
    if how == "not-json":
        raw = draw(st.sampled_from([b"", b"{", b'{"a": }', b"\xff\xfe", b"[1, 2]", b'"s"', b"null"]))
        return raw, raw != b"" or endpoint != "/admin/sessions"  # the admin API takes a missing body as {}
    fragment, refused = draw(fragments)
    at = draw(st.sampled_from([*paths(base), ("extra",)]))
    raw = json.dumps(put(base, at, HOLE)).replace(json.dumps(HOLE), fragment)
    return raw.encode(), refused


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from transformers import AutoTokenizer

    from sim.tiny_checkpoint import build_tiny_checkpoint

    d = tmp_path_factory.mktemp("agent_hostile")
    ckpt = build_tiny_checkpoint(d / "tiny")
    (d / "script.json").write_text(json.dumps({"default": {"completion": "ok"}}))
    args = ["--engine", "scripted", "--script", str(d / "script.json"), "--model-path", str(ckpt)]
    with launch_fake_sglang(args) as eng:
        g = Gateway(AutoTokenizer.from_pretrained(ckpt), eng.url, admin_token="adm")
        url = run(g.start())
        try:
            sess = run(g.open_session({"max_new_tokens": 4}, 512))
            with httpx.Client(base_url=url, timeout=60) as client:
                yield {"gw": g, "client": client, "sess": sess, "engine": eng.url.split("://", 1)[1]}
        finally:
            run(g.stop())


def check(ctx: dict[str, Any], r: httpx.Response, api: str, allowed: set[int]) -> None:
    assert r.status_code in allowed, (r.status_code, r.text[:300])
    assert ctx["engine"] not in r.text  # the engine's host:port is never told to a client
    if r.status_code >= 400:
        body = r.json()
        if api == "anthropic":
            assert body["type"] == "error" and isinstance(body["error"]["type"], str), body
            assert isinstance(body["error"]["message"], str) and body["error"]["message"]
        else:  # OpenAI's shape, which the admin API shares
            err = body["error"]
            assert isinstance(err["message"], str) and err["message"] and err["code"] == r.status_code, body
            assert err["type"] == "invalid_request_error", body
    assert ctx["client"].get("/health").status_code == 200


def drive_api(ctx: dict[str, Any], endpoints: list[str], api: str) -> None:
    client: httpx.Client = ctx["client"]
    key = ctx["sess"]["api_key"]
    seen: set[int] = set()

    @settings(deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.sampled_from(endpoints).flatmap(lambda e: st.tuples(st.just(e), hostile_body(e))), st.booleans())
    def one(req: tuple[str, tuple[bytes, bool]], key_in_path: bool) -> None:
        endpoint, (raw, refused) = req
        path, headers = (f"/s/{key}{endpoint}", {}) if key_in_path else (endpoint, {"x-api-key": key})
        r = client.post(path, content=raw, headers={**headers, "content-type": "application/json"})
        check(ctx, r, api, {400} if refused else {200, 400})
        seen.add(r.status_code)

    one()
    assert 400 in seen


def test_chat_completions_hostile_inputs(gw: dict[str, Any]) -> None:
    drive_api(gw, ["/v1/chat/completions"], "openai")


def test_responses_hostile_inputs(gw: dict[str, Any]) -> None:
    drive_api(gw, ["/v1/responses"], "openai")


def test_anthropic_messages_hostile_inputs(gw: dict[str, Any]) -> None:
    drive_api(gw, ["/v1/messages", "/v1/messages/count_tokens"], "anthropic")


sids = st.one_of(
    st.text(min_size=1, max_size=40),
    surrogate.map(lambda s: json.loads(f'"{s}"')),
    st.sampled_from(["sess-0000000000000000", "127.0.0.1:30000", "..", "a" * 300, "%ED%A0%80", "sess-\u00e9"]),
)


def test_admin_api_hostile_inputs(gw: dict[str, Any]) -> None:
    client: httpx.Client = gw["client"]
    seen: set[int] = set()

    @settings(deadline=None, suppress_health_check=list(HealthCheck))
    @given(
        st.sampled_from(["create", "get", "finish"]),
        hostile_body("/admin/sessions"),
        sids,
        st.sampled_from(["adm", "wrong", None]),
    )
    def one(op: str, body: tuple[bytes, bool], sid: str, token: str | None) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        if op == "create":
            raw, refused = body
            r = client.post("/admin/sessions", content=raw, headers=headers)
            allowed = {401} if token != "adm" else {400} if refused else {200, 400}
        else:
            quoted = urllib.parse.quote(sid.encode("utf-8", "surrogatepass"), safe="")
            path = f"/admin/sessions/{quoted}" + ("/finish" if op == "finish" else "")
            r = client.post(path, headers=headers) if op == "finish" else client.get(path, headers=headers)
            # a quoted "/" or ".." can leave the admin routes: the catch-all then answers 404 too
            allowed = {401, 404} if token != "adm" else {404}
        check(gw, r, "admin", allowed)
        seen.add(r.status_code)

    one()
    assert {400, 404} <= seen
