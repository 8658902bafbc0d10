"""Every endpoint of the mock router answers malformed input as sglang-router 0.3.2 does (415 / 400 / 422 with a
plain-text reason, 400 / 404 JSON for worker ids), never a 5xx, and keeps routing afterwards.

The router and one fake engine behind it run in-process (aiohttp test servers on 127.0.0.1, one event loop).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import pytest
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import given
from hypothesis import strategies as st

from sim.fake_sglang.mock_router import Router, build_router_app
from sim.fake_sglang.router_body import DATA_PREFIX, PARSE_PREFIX, UNSUPPORTED_MEDIA
from sim.fake_sglang.server import build_app
from sim.fake_sglang.synthetic_engine import DEFAULT_CONFIG, SyntheticEngine

pytestmark = pytest.mark.cpu

JSON_CT = {"Content-Type": "application/json"}


@dataclass
class Harness:
    loop: asyncio.AbstractEventLoop
    client: TestClient
    router: Router
    app: Any

    def call(self, method: str, path: str, data: bytes = b"", headers: dict | None = None) -> tuple[int, str, str]:
        async def go() -> tuple[int, str, str]:
            async with self.client.request(method, path, data=data, headers=headers or {}) as r:
                return r.status, r.content_type, await r.text()

        return self.loop.run_until_complete(asyncio.wait_for(go(), 30))


@pytest.fixture(scope="module")
def routed():
    loop = asyncio.new_event_loop()
    engine = SyntheticEngine(config=dict(DEFAULT_CONFIG, output_len={"dist": "fixed", "value": 2}))
    router = Router("round_robin")

    async def start() -> tuple[TestServer, TestClient]:
        worker = TestServer(build_app(engine, server_args={"tp_size": 1}), host="127.0.0.1")
        await worker.start_server()
        router.add(str(worker.make_url("")).rstrip("/"))
        client = TestClient(TestServer(build_router_app(router), host="127.0.0.1"))
        await client.start_server()
        return worker, client

    worker, client = loop.run_until_complete(start())
    task = loop.create_task(engine.run())
    try:
        yield Harness(loop, client, router, client.app)
    finally:
        loop.run_until_complete(engine.stop())
        task.cancel()
        loop.run_until_complete(asyncio.gather(task, return_exceptions=True))
        loop.run_until_complete(client.close())
        loop.run_until_complete(worker.close())
        loop.close()


finite = st.floats(allow_nan=False, allow_infinity=False)  # NaN / Infinity are not JSON: a parse error, not a type one
scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | finite | st.text(max_size=8)
json_values = st.recursive(
    scalars, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3), max_leaves=6
)
containers = st.lists(json_values, max_size=3) | st.dictionaries(st.text(max_size=5), json_values, max_size=3)
not_str = st.booleans() | st.integers() | finite | containers
not_bool = st.integers() | finite | st.text(max_size=5) | containers
not_number = st.booleans() | st.text(max_size=5) | containers
not_i32 = not_number | finite | st.integers(min_value=2**31) | st.integers(max_value=-(2**31) - 1)  # 5.0 too
not_u32 = not_number | finite | st.integers(max_value=-1) | st.integers(min_value=2**32)
not_u16 = not_number | finite | st.integers(max_value=-1) | st.integers(min_value=2**16)

# serde field types of the router 0.3.2 (seen on the binary): null is accepted for each of these optional fields
GENERATE_FIELDS = {
    "text": not_str, "rid": not_str, "stream": not_bool, "return_logprob": not_bool,
    "input_ids": st.text(max_size=4) | st.lists(st.text(max_size=2) | st.booleans() | st.floats(0.1, 0.9), min_size=1)
    | st.lists(st.integers(min_value=2**31), min_size=1, max_size=2) | st.dictionaries(st.text(max_size=3), scalars),
    "sampling_params": not_str.filter(lambda v: not isinstance(v, dict)) | st.one_of(
        st.fixed_dictionaries({"temperature": not_number}), st.fixed_dictionaries({"top_p": not_number}),
        st.fixed_dictionaries({"max_new_tokens": not_u32}), st.fixed_dictionaries({"top_k": not_i32}),
        st.fixed_dictionaries({"stop_token_ids": not_str.filter(lambda v: not isinstance(v, list)) | st.lists(not_u32, min_size=1)}),
        st.fixed_dictionaries({"stop": st.integers() | st.lists(st.integers(), min_size=1)}),
        st.fixed_dictionaries({"n": not_u32}), st.fixed_dictionaries({"ignore_eos": not_bool}),
    ),
    "logprob_start_len": not_i32, "bootstrap_room": not_i32, "priority": not_i32,
    "session_params": not_str.filter(lambda v: not isinstance(v, dict)),
}  # fmt: skip
WORKER_FIELDS = {
    "url": not_str | st.none(), "worker_type": not_str, "model_id": not_str, "priority": not_u32,
    "bootstrap_port": not_u16, "dp_aware": not_bool, "labels": not_str.filter(lambda v: not isinstance(v, dict)),
}  # fmt: skip
JSON_ENDPOINTS = {
    "/generate": ({"input_ids": [1, 2]}, GENERATE_FIELDS),
    "/workers": ({"url": "http://x"}, WORKER_FIELDS),
}


@dataclass
class Case:
    method: str
    path: str
    body: bytes
    headers: dict[str, str]
    want: tuple[int, ...]


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj).encode()


@st.composite
def malformed_json_body(draw: st.DrawFn) -> Case:
    path = draw(st.sampled_from(sorted(JSON_ENDPOINTS)))
    base, fields = JSON_ENDPOINTS[path]
    kind = draw(
        st.sampled_from(["content_type", "syntax", "surrogate", "top_level", "missing", "dup"] + ["field"] * 6)
    )
    if kind == "content_type":
        ct = draw(st.sampled_from(["text/plain", "application/x-www-form-urlencoded", "application/octet-stream"]))
        return Case("POST", path, _dumps(base), {"Content-Type": ct}, (415,))
    if kind == "syntax":
        body = draw(
            st.sampled_from([b"", b"  ", b"not json", b"\xff\xfe", b'{"a": NaN}', b"[Infinity]", b"{,}"])
            | st.just(_dumps(base) + b" trailing")
            | st.just(_dumps(base)[:-1])
        )
        return Case("POST", path, body, JSON_CT, (400,))
    if kind == "surrogate":
        where = draw(st.sampled_from(["value", "key"]))
        s = draw(st.text(max_size=4)) + "\ud800"
        body = dict(base, **({"x": s} if where == "value" else {s: 1}))
        return Case("POST", path, _dumps(body), JSON_CT, (400,))
    if kind == "top_level":  # serde: a struct from a scalar is a type error; from a list, field by field
        top = draw(scalars | st.lists(json_values, max_size=3))
        if isinstance(top, list) and len(top) >= len(fields):
            top = top[:1]
        return Case("POST", path, _dumps(top), JSON_CT, (422,))
    if kind == "field":
        name = draw(st.sampled_from(sorted(fields)))
        return Case("POST", path, _dumps(dict(base, **{name: draw(fields[name])})), JSON_CT, (422,))
    if kind == "missing" and path == "/workers":
        return Case("POST", path, _dumps({"worker_type": "regular"}), JSON_CT, (422,))
    key = next(iter(base))  # a field given twice
    raw = _dumps(base)[:-1] + b", " + json.dumps(key).encode() + b": " + _dumps(base[key]) + b"}"
    return Case("POST", path, raw, JSON_CT, (422,))


worker_ids = st.text(
    st.characters(whitelist_categories=("L", "N", "P", "S", "Zs"), blacklist_characters="/?#%\\."),
    min_size=1,
    max_size=40,
).filter(lambda s: not _is_uuid(s))


def _is_uuid(s: str) -> bool:
    try:
        uuid.UUID(s)
    except ValueError:
        return False
    return True


@st.composite
def malformed(draw: st.DrawFn) -> Case:
    kind = draw(st.integers(0, 9))
    if kind <= 6:
        return draw(malformed_json_body())
    if kind <= 8:  # a worker id that is no UUID (400), or a UUID of no worker (404)
        method = draw(st.sampled_from(["GET", "DELETE"]))
        wid = draw(worker_ids)
        if draw(st.booleans()):
            return Case(method, f"/workers/{draw(st.uuids())}", b"", {}, (404,))
        return Case(method, "/workers/" + quote(wid, safe=""), b"", {}, (400,))
    method, path = draw(st.sampled_from([("GET", "/health"), ("GET", "/workers")]))  # they read no body
    return Case(method, path, draw(st.binary(max_size=20)), JSON_CT, (200,))


def assert_router_answer(case: Case, status: int, content_type: str, text: str) -> None:
    what = f"{case.method} {case.path} {case.headers} {case.body[:120]!r}"
    assert status in case.want, f"{what}: {status} {text[:300]}"
    if status == 415:
        assert text == UNSUPPORTED_MEDIA
    elif status in (400, 422) and case.path in JSON_ENDPOINTS:
        assert content_type == "text/plain" and text.startswith(PARSE_PREFIX if status == 400 else DATA_PREFIX), text
    elif status in (400, 404):
        body = json.loads(text)
        assert body["error"] and body["code"] == ("BAD_REQUEST" if status == 400 else "WORKER_NOT_FOUND"), text


def assert_still_routing(routed: Harness) -> None:
    assert routed.call("GET", "/health")[::2] == (200, "OK")
    status, _, text = routed.call("POST", "/generate", _dumps({"input_ids": [1, 2]}), JSON_CT)
    assert status == 200 and len(json.loads(text)["output_ids"]) == 2, text[:300]
    assert len(routed.router.workers) == 1  # no malformed /workers body registered anything


@given(case=malformed())
def test_malformed_input_gets_the_routers_4xx_and_it_keeps_routing(routed, case):
    status, content_type, text = routed.call(case.method, case.path, case.body, case.headers)
    assert status < 500, f"{case}: {status} {text[:300]}"
    assert_router_answer(case, status, content_type, text)
    assert_still_routing(routed)


def test_every_route_is_driven_and_unknown_ones_answer_empty(routed):
    routes = {(r.method, r.resource.canonical) for r in routed.app.router.routes() if r.method != "HEAD"}
    driven = {("POST", "/generate"), ("POST", "/workers"), ("GET", "/workers/{wid}"), ("DELETE", "/workers/{wid}")}
    assert routes - driven - {("GET", "/health"), ("GET", "/workers")} == set()
    assert routed.call("GET", "/no_such_route")[::2] == (404, "")
    assert routed.call("GET", "/generate")[::2] == (405, "")
    assert_still_routing(routed)
