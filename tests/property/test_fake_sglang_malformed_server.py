"""Every endpoint of the fake SGLang server answers malformed input as SGLang 0.5.23 does: a 4xx with an error body,
never a 5xx, and the server keeps serving (and keeps its state) afterwards.

The server runs in-process (aiohttp test server on 127.0.0.1) over a synthetic engine; hypothesis builds bodies
that are malformed for the endpoint at hand — not JSON, JSON of the wrong type, wrong content type, empty, nested
deeper than a parser recurses, fields of the wrong type, missing required fields, lone surrogates, out-of-range
sampling params, out-of-vocabulary token ids, bad weight-update payloads.
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
from dataclasses import dataclass
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import given
from hypothesis import strategies as st

from sim.fake_sglang.server import build_app
from sim.fake_sglang.synthetic_engine import DEFAULT_CONFIG, SyntheticEngine

pytestmark = pytest.mark.cpu

VOCAB = 512
JSON_CT = {"Content-Type": "application/json"}
_BOOL_WORDS = {"0", "off", "f", "false", "n", "no", "1", "on", "t", "true", "y", "yes"}
SAMPLING_KEYS = {
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema", "regex",
    "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
    "stream_interval", "logit_bias", "sampling_seed", "custom_params", "beam_width", "watermark", "choice",
}  # fmt: skip


@dataclass
class Harness:
    loop: asyncio.AbstractEventLoop
    client: TestClient
    engine: SyntheticEngine
    app: Any

    def call(self, method: str, path: str, data: bytes = b"", headers: dict | None = None) -> tuple[int, str]:
        async def go() -> tuple[int, str]:
            async with self.client.request(method, path, data=data, headers=headers or {}) as r:
                return r.status, await r.text()

        return self.loop.run_until_complete(asyncio.wait_for(go(), 30))


@pytest.fixture(scope="module")
def fake(tmp_path_factory):
    loop = asyncio.new_event_loop()
    cfg = dict(DEFAULT_CONFIG, vocab_size=VOCAB, output_len={"dist": "fixed", "value": 2})
    engine = SyntheticEngine(config=cfg, max_running_requests=16, random_seed=0)
    log = tmp_path_factory.mktemp("malformed") / "requests.jsonl"
    app = build_app(engine, server_args={"tp_size": 1, "host": "127.0.0.1"}, request_log=str(log))

    async def start() -> TestClient:
        client = TestClient(TestServer(app, host="127.0.0.1"))
        await client.start_server()
        return client

    client = loop.run_until_complete(start())
    task = loop.create_task(engine.run())
    try:
        yield Harness(loop, client, engine, app)
    finally:
        loop.run_until_complete(engine.stop())
        task.cancel()
        loop.run_until_complete(asyncio.gather(task, return_exceptions=True))
        loop.run_until_complete(client.close())
        loop.close()
    assert log.read_text().count("\n") > 0  # every answer above was logged, odd bodies included


# ---- what a malformed value is, per declared type ------------------------------------------------------------
scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12)
json_values = st.recursive(
    scalars, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3), max_leaves=8
)
containers = st.lists(json_values, max_size=3) | st.dictionaries(st.text(max_size=6), json_values, max_size=3)
nested = st.integers(2, 400).map(lambda d: json.loads('{"a": ' * d + "1" + "}" * d))
not_int_text = st.text(max_size=8).filter(lambda s: not _parses(int, s))
not_float_text = st.text(max_size=8).filter(lambda s: not _parses(float, s))

bad_str = st.integers() | st.floats() | st.booleans() | containers | nested  # for a str field (None: optional)
bad_req_str = bad_str | st.none()  # for a required str field
bad_bool = (
    st.none()
    | st.text(max_size=8).filter(lambda s: s.strip().lower() not in _BOOL_WORDS)
    | st.integers().filter(lambda i: i not in (0, 1))
    | st.floats().filter(lambda f: f not in (0, 1))
    | containers
    | nested
)
bad_int = (
    st.none() | st.floats().filter(lambda f: not math.isfinite(f) or f != int(f)) | not_int_text | containers | nested
)
bad_str_list = st.integers() | st.text(max_size=5) | st.dictionaries(st.text(max_size=4), scalars, max_size=2)
bad_str_list |= st.lists(st.integers() | st.none() | containers, min_size=1, max_size=3)  # an item not a str
bad_literal = st.text(max_size=10).filter(
    lambda s: s not in ("abort", "retract", "in_place", "target", "draft", "all")
)
bad_literal |= st.integers() | st.none() | containers
FAULT_MODES = ("none", "hang", "slow", "error")
bad_fault_mode = st.text(max_size=10).filter(lambda s: s not in FAULT_MODES) | st.integers() | st.none() | containers


def _parses(kind: type, s: str) -> bool:
    try:
        kind(s.strip())
    except ValueError:
        return False
    return True


lone_surrogate = st.text(max_size=5).flatmap(lambda t: st.sampled_from([t + "\ud800", "\udfff" + t, t + "\udbff x"]))
not_base64 = st.text(min_size=1, max_size=12).filter(lambda s: not _strict_b64(s))
garbage_pickle = st.binary(max_size=32).map(lambda b: base64.b64encode(b"\xff" + b).decode())  # 0xff: no opcode


def _strict_b64(s: str) -> bool:
    try:
        base64.b64decode(s, validate=True)
    except ValueError:
        return False
    return True


# ---- the endpoints: method, a valid base body, and malformed values per field -----------------------------------
@dataclass
class Endpoint:
    method: str
    base: dict[str, Any]  # required fields, valid; a bad field replaces or joins them
    bad_fields: dict[str, st.SearchStrategy]
    body_required: bool = True


bad_sampling = st.one_of(
    st.fixed_dictionaries({"temperature": st.text(max_size=4) | st.booleans() | containers}),
    st.fixed_dictionaries({"temperature": st.floats(max_value=-1e-6) | st.just(math.nan) | st.just(math.inf)}),
    st.fixed_dictionaries({"max_new_tokens": st.integers(max_value=-1) | st.floats() | st.text(max_size=3)}),
    st.fixed_dictionaries({"top_p": st.floats(max_value=0) | st.floats(min_value=1.001) | st.just(math.nan)}),
    st.fixed_dictionaries({"top_k": st.integers(max_value=-2) | st.just(0)}),
    st.fixed_dictionaries({"min_p": st.floats(max_value=-0.001) | st.floats(min_value=1.001)}),
    st.fixed_dictionaries({"n": st.integers().filter(lambda n: n not in (0, 1))}),
    st.fixed_dictionaries({"stop": st.integers() | st.lists(st.integers(), min_size=1, max_size=2)}),
    st.fixed_dictionaries({"stop_token_ids": st.text(max_size=3) | st.lists(st.text(max_size=2), min_size=1)}),
    st.fixed_dictionaries({"sampling_seed": st.integers(min_value=2**63) | st.integers(max_value=-(2**63) - 1)}),
    st.fixed_dictionaries({"min_new_tokens": st.integers(3, 9), "max_new_tokens": st.integers(0, 2)}),
    st.fixed_dictionaries({"repetition_penalty": st.floats(max_value=0) | st.floats(min_value=2.001)}),
    st.fixed_dictionaries({"logit_bias": st.fixed_dictionaries({"99999": st.floats(-1, 1)})}),
    st.dictionaries(st.text(min_size=1, max_size=10).filter(lambda k: k not in SAMPLING_KEYS), scalars, min_size=1),
)
GENERATE = Endpoint(
    "POST",
    {"input_ids": [1, 2]},
    {
        "input_ids": st.one_of(
            st.text(max_size=5),
            st.integers(),
            st.dictionaries(st.text(max_size=3), scalars, max_size=2),
            st.lists(st.integers(VOCAB, 10**9) | st.integers(max_value=-1), min_size=1, max_size=3),  # out of vocab
            st.lists(st.text(max_size=2) | st.floats() | st.booleans(), min_size=1, max_size=3),
            st.lists(st.lists(st.text(max_size=2), min_size=1), min_size=1, max_size=2),
            st.just([]),
            st.just([[]]),
            st.just([2**70]),
        ),  # fmt: skip
        "text": st.integers()
        | st.dictionaries(st.text(max_size=3), scalars, max_size=2)
        | lone_surrogate
        | st.lists(st.integers() | lone_surrogate, min_size=1, max_size=2),
        "sampling_params": scalars.filter(lambda x: x is not None) | bad_sampling | st.lists(st.just({}), min_size=1),
        "rid": st.integers() | st.floats() | st.lists(st.text(max_size=3), min_size=1, max_size=2),
        "stream": st.integers() | st.text(max_size=4) | containers,
        "return_logprob": st.integers() | st.text(max_size=4) | st.lists(st.booleans(), min_size=1, max_size=2),
        "return_text_in_logprobs": st.integers() | st.text(max_size=4) | st.none(),
    },
)
ENDPOINTS: dict[str, Endpoint] = {
    "/generate": GENERATE,
    "/abort_request": Endpoint("POST", {}, {"rid": bad_str, "abort_all": bad_bool}),
    "/pause_generation": Endpoint("POST", {}, {"mode": bad_literal}),
    "/continue_generation": Endpoint("POST", {}, {"torch_empty_cache": bad_bool}),
    "/update_weights_from_tensor": Endpoint(
        "POST",
        {"serialized_named_tensors": [base64.b64encode(b"\xff").decode()]},
        {
            "serialized_named_tensors": bad_str | st.lists(st.integers() | not_base64 | garbage_pickle, min_size=1),
            "flush_cache": bad_bool,
            "weight_version": bad_str,
            "load_format": bad_str,
        },
    ),
    "/update_weights_from_disk": Endpoint(
        "POST", {"model_path": ""}, {"model_path": bad_req_str, "weight_version": bad_str, "token_step": bad_int}
    ),
    "/update_weight_version": Endpoint("POST", {"new_version": "v"}, {"new_version": bad_req_str}),
    "/init_weights_update_group": Endpoint(
        "POST",
        {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2},
        {
            "master_address": bad_req_str,
            "master_port": bad_int,
            "rank_offset": bad_int,
            "world_size": bad_int,
            "group_name": bad_req_str,
            "backend": bad_req_str,
        },  # fmt: skip
    ),
    "/destroy_weights_update_group": Endpoint("POST", {}, {"group_name": bad_req_str}),
    "/update_weights_from_distributed": Endpoint(
        "POST",
        {"names": ["w"], "dtypes": ["float32"], "shapes": [[1]]},
        {
            "names": bad_str_list,
            "dtypes": bad_str_list,
            "flush_cache": bad_bool,
            "weight_version": bad_str,
            "shapes": st.integers() | st.lists(st.integers() | st.lists(st.floats(0.1, 0.9), min_size=1), min_size=1),
        },  # fmt: skip
    ),
    "/begin_weight_update": Endpoint("POST", {}, {"selector": bad_literal}),
    "/end_weight_update": Endpoint("POST", {}, {}),
    "/release_memory_occupation": Endpoint("POST", {}, {"tags": bad_str_list}),
    "/resume_memory_occupation": Endpoint("POST", {}, {"tags": bad_str_list}),
    "/get_weights_by_name": Endpoint(
        "POST", {"name": "model.norm.weight"}, {"name": bad_req_str, "truncate_size": bad_int}
    ),
    "/weights_checker": Endpoint(
        "POST",
        {},
        {"action": bad_req_str, "allow_quant_error": bad_bool, "skip_tensor_list": bad_str_list},
        body_required=False,
    ),
    "/v1/chat/completions": Endpoint(
        "POST",
        {"messages": [{"role": "user", "content": "hi"}]},
        {
            "messages": scalars | st.just([]) | st.lists(scalars, min_size=1, max_size=2),
            "stream": st.just(True),
            "n": st.integers(2, 8),
        },
    ),
    "/_fault": Endpoint(
        "POST",
        {},
        {
            "mode": bad_fault_mode,
            "delay_s": st.none() | not_float_text | containers | st.floats(max_value=-0.001) | st.just(math.nan),
        },
        body_required=False,
    ),
}
# Endpoints that take no body: whatever is sent, they answer (never 5xx); a bad query is a 400.
BODYLESS = {
    ("GET", "/health"), ("GET", "/health_generate"), ("GET", "/get_model_info"), ("GET", "/model_info"),
    ("GET", "/get_server_info"), ("GET", "/server_info"), ("POST", "/flush_cache"),
    ("GET", "/flush_cache"), ("GET", "/v1/models"),
}  # fmt: skip


@dataclass
class Case:
    method: str
    path: str
    body: bytes
    headers: dict[str, str]
    must_refuse: bool = True


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj).encode()


@st.composite
def structural(draw: st.DrawFn, path: str, ep: Endpoint) -> Case:
    """A body that is malformed whatever the endpoint: not JSON, not an object, wrong content type, too deep."""
    kind = draw(st.sampled_from(["not_json", "truncated", "not_object", "content_type", "empty", "deep"]))
    if kind == "not_json":
        body = draw(st.sampled_from([b"\x01", b"\xff", b"{'a': 1}", b"{,}"])) + draw(st.binary(max_size=20))
    elif kind == "truncated":
        body = _dumps(dict(ep.base, x=draw(json_values)))[:-1]
    elif kind == "not_object":
        top = st.lists(json_values, max_size=3) | st.text(max_size=8) | st.integers() | st.booleans() | st.floats()
        body = _dumps(draw(top if not ep.body_required else top | st.none()))
    elif kind == "content_type":
        ct = draw(st.sampled_from([None, "text/plain", "application/x-www-form-urlencoded", "application/xml"]))
        headers = {} if ct is None else {"Content-Type": ct}
        return Case(ep.method, path, _dumps(ep.base or {"x": 1}), headers)
    elif kind == "empty":
        return Case(ep.method, path, b"", JSON_CT, must_refuse=ep.body_required)
    else:
        # past any parser's recursion limit (a parse error) or, under a raised limit, an array (not an object)
        depth = draw(st.integers(1500, 30000))
        body = ("[" * depth + "1" + "]" * depth).encode()
    return Case(ep.method, path, body, JSON_CT)


@st.composite
def bad_field(draw: st.DrawFn, path: str, ep: Endpoint) -> Case:
    """A JSON object that is malformed in one field, or misses a required one, or has a key that is not text."""
    choices = ["field"] * bool(ep.bad_fields) + ["missing"] * bool(ep.base) + ["surrogate_key"] * (path == "/generate")
    kind = draw(st.sampled_from(choices or ["none"]))
    if kind == "field":
        name = draw(st.sampled_from(sorted(ep.bad_fields)))
        body = dict(ep.base, **{name: draw(ep.bad_fields[name])})
        if path == "/generate" and name == "text":
            body.pop("input_ids")
    elif kind == "missing":
        keep = draw(st.sets(st.sampled_from(sorted(ep.base)), max_size=len(ep.base) - 1))
        body = {k: ep.base[k] for k in keep}
        if path == "/generate":
            body["sampling_params"] = draw(st.just({}) | st.just({"max_new_tokens": 1}))
    elif kind == "surrogate_key":
        body = dict(ep.base, **{draw(lone_surrogate): draw(scalars)})
    else:
        return draw(structural(path, ep))
    return Case(ep.method, path, _dumps(body), JSON_CT)


@st.composite
def malformed(draw: st.DrawFn) -> Case:
    if draw(st.integers(0, 9)) == 0:  # endpoints that read no body: never a 5xx, a bad query a 400
        method, path = draw(st.sampled_from(sorted(BODYLESS)))
        if path == "/flush_cache" and draw(st.booleans()):
            timeout = draw(not_float_text | st.floats(max_value=-0.001).map(str))
            from urllib.parse import quote

            return Case(method, f"{path}?timeout={quote(timeout)}", b"", {})
        return Case(method, path, draw(st.binary(max_size=30)), JSON_CT, must_refuse=False)
    path = draw(st.sampled_from(sorted(ENDPOINTS)))
    ep = ENDPOINTS[path]
    return draw(structural(path, ep) | bad_field(path, ep))


def assert_error_answer(status: int, text: str, what: str) -> None:
    assert 400 <= status < 500, f"{what}: {status} {text[:300]}"
    body = json.loads(text)
    assert isinstance(body, dict), what
    err = body.get("error")
    assert (
        (isinstance(err, str) and err)  # the /generate JSON contract (api_contract.py)
        or (isinstance(err, dict) and err.get("message"))  # _create_error_response
        or (body.get("object") == "error" and body.get("message") and body.get("code") == status)  # validation
        or (body.get("success") is False and body.get("message"))  # weight updates
        or body.get("detail")  # FastAPI's 404 / 405
    ), f"{what}: no error body: {text[:300]}"


def assert_still_serving(fake: Harness) -> None:
    assert fake.call("GET", "/health") == (200, "")
    status, text = fake.call("POST", "/generate", _dumps({"input_ids": [1, 2]}), JSON_CT)
    assert status == 200 and len(json.loads(text)["output_ids"]) == 2, text[:300]
    e = fake.engine  # nothing a refused request touched is left behind
    assert not e.requests and e.num_unfinished == 0 and not e.paused and not e.released_tags
    assert e.weight_version == "default"


@given(case=malformed())
def test_malformed_input_gets_a_4xx_error_and_the_server_keeps_serving(fake, case):
    status, text = fake.call(case.method, case.path, case.body, case.headers)
    what = f"{case.method} {case.path} {case.headers} {case.body[:120]!r}"
    assert status < 500, f"{what}: {status} {text[:300]}"
    if case.must_refuse:
        assert_error_answer(status, text, what)
    assert_still_serving(fake)


def test_every_route_is_driven(fake):
    """A new endpoint must join the tables above (and so the property), or it goes untested."""
    routes = {(r.method, r.resource.canonical) for r in fake.app.router.routes() if r.method != "HEAD"}
    driven = {(ep.method, path) for path, ep in ENDPOINTS.items()} | BODYLESS
    also = {("PUT", "/generate"), ("GET", "/weights_checker"), ("GET", "/release_memory_occupation")}
    also |= {("GET", "/resume_memory_occupation"), ("GET", "/get_weights_by_name")}
    assert routes - driven - also == set()
    for method, path in sorted(also):  # the same handlers under another method: one malformed body each
        status, text = fake.call(method, path, b"\x01", JSON_CT)
        assert_error_answer(status, text, f"{method} {path}")


def test_unknown_route_and_method_get_fastapi_answers(fake):
    assert fake.call("GET", "/no_such_endpoint") == (404, json.dumps({"detail": "Not Found"}))
    assert fake.call("GET", "/generate") == (405, json.dumps({"detail": "Method Not Allowed"}))
    assert_still_serving(fake)
