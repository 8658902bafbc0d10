"""Robustness of the gateway against malformed and hostile requests (hypothesis): only the specified status
codes (400 bad body naming the field, 401 credential, 404 unknown session, 409 finished session, 413 body too
large; 200 when the request happens to be valid), never a 5xx, the gateway stays up, and a session whose
credential was never used is untouched."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sim.fake_sglang.testing import launch_fake_sglang
from slime.agent.gateway import Gateway
from slime.utils.async_utils import run

pytestmark = pytest.mark.cpu

LIMIT = 64 * 1024
ALLOWED = {200, 400, 401, 404, 409, 413}
N_EXAMPLES = 500 if os.environ.get("CI") == "true" else 150


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from transformers import AutoTokenizer

    from sim.tiny_checkpoint import build_tiny_checkpoint

    d = tmp_path_factory.mktemp("agent_fuzz")
    ckpt = build_tiny_checkpoint(d / "tiny")
    (d / "script.json").write_text(json.dumps({"default": {"completion": "ok"}}))
    args = ["--engine", "scripted", "--script", str(d / "script.json"), "--model-path", str(ckpt)]
    with launch_fake_sglang(args) as eng:
        g = Gateway(AutoTokenizer.from_pretrained(ckpt), eng.url, admin_token="adm", max_body_bytes=LIMIT)
        url = run(g.start())
        try:
            own = run(g.open_session({}, 512))
            other = run(g.open_session({}, 512))
            victim = run(g.open_session({}, 512))
            done = run(g.open_session({}, 512))
            run(g.finish_session(done["session_id"]))
            with httpx.Client(base_url=url, timeout=30) as client:
                yield {"gw": g, "client": client, "own": own, "other": other, "victim": victim, "done": done}
        finally:
            run(g.stop())


json_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(-5, 10**6), st.floats(allow_nan=False), st.text(max_size=20)
)
json_any = st.recursive(
    json_leaf,
    lambda c: st.one_of(st.lists(c, max_size=4), st.dictionaries(st.text(max_size=10), c, max_size=4)),
    max_leaves=12,
)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "tool", "developer", "bogus", 3]), "content": json_any}
)
field_values = {
    "model": st.one_of(st.just("m"), json_any),
    "messages": st.one_of(st.lists(message, max_size=3), json_any),
    "input": st.one_of(st.text(max_size=20), st.lists(json_any, max_size=3), json_any),
    "tools": st.one_of(st.lists(json_any, max_size=2), json_any),
    "max_tokens": st.one_of(st.integers(-3, 64), json_any),
    "stream": st.booleans(),
    "system": json_any,
    "temperature": json_any,
    "stop": json_any,
}
bodies = st.one_of(
    st.dictionaries(st.sampled_from(sorted(field_values)), st.none(), max_size=6).flatmap(
        lambda keys: st.fixed_dictionaries({k: field_values[k] for k in keys})
    ),
    json_any,
)


@st.composite
def requests(draw: st.DrawFn, ctx: dict[str, Any]) -> tuple[str, dict[str, str], bytes]:
    endpoint = draw(
        st.sampled_from(["/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens"])
    )
    who = draw(st.sampled_from(["own", "other", "done", "wrong", "none"]))
    key = {"wrong": "sk-wrong", "none": None}[who] if who in ("wrong", "none") else ctx[who]["api_key"]
    where = draw(st.sampled_from(["bearer", "x-api-key", "path-key", "path-sid", "victim-sid"]))
    headers: dict[str, str] = {"content-type": "application/json"}
    path = endpoint
    if where == "bearer" and key:
        headers["Authorization"] = f"Bearer {key}"
    elif where == "x-api-key" and key:
        headers["x-api-key"] = key
    elif where == "path-key" and key:
        path = f"/s/{key}{endpoint}"
    elif where in ("path-sid", "victim-sid"):
        sid = (
            ctx["victim"]["session_id"]
            if where == "victim-sid"
            else draw(st.sampled_from(["sess-nope", ctx["own"]["session_id"]]))
        )
        path = f"/sessions/{sid}{endpoint}"
        if key:
            headers["x-api-key"] = key
    kind = draw(st.sampled_from(["json", "json", "bytes", "huge"]))
    if kind == "bytes":
        raw = draw(st.binary(max_size=64))
    else:
        raw = json.dumps(draw(bodies)).encode()
        if kind == "huge":
            raw = b'{"pad": "' + b"x" * draw(st.integers(LIMIT, 2 * LIMIT)) + b'"}'
    return path, headers, raw


def test_hostile_requests_get_only_specified_codes(gw: dict[str, Any]) -> None:
    client: httpx.Client = gw["client"]

    @settings(max_examples=N_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
    @given(requests(gw))
    def one(req: tuple[str, dict[str, str], bytes]) -> None:
        path, headers, raw = req
        r = client.post(path, content=raw, headers=headers)
        assert r.status_code in ALLOWED, (r.status_code, r.text[:300])
        if r.status_code == 400:
            msg = r.json()["error"]["message"]
            assert ":" in msg  # names the field ("messages[0].role: unknown role")
        assert client.get("/health").status_code == 200

    one()
    # the victim's credential was never presented: its session saw nothing and still works
    g: Gateway = gw["gw"]
    victim = run(g.store.get(gw["victim"]["session_id"]))
    assert victim.num_requests == 0 and not victim.chain and not victim.finished
    r = client.post(
        "/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        headers={"Authorization": f"Bearer {gw['victim']['api_key']}"},
    )
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "ok"
    assert len(run(g.finish_session(gw["victim"]["session_id"]))) == 1


def test_default_body_limit_is_64_mib(gw: dict[str, Any]) -> None:
    # a fresh gateway with the default limit: 64 MiB + 1 KiB is refused with 413, not a crash
    g: Gateway = gw["gw"]
    big = Gateway(g.tokenizer, g.engine.url)
    url = run(big.start())
    try:
        sess = run(big.open_session({}, 0))
        body = b'{"pad": "' + b"x" * ((64 << 20) + 1024) + b'"}'
        r = httpx.post(f"{url}/v1/messages", content=body, headers={"x-api-key": sess["api_key"]}, timeout=60)
        assert r.status_code == 413 and r.json()["type"] == "error"
    finally:
        run(big.stop())
