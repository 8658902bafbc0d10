"""The mock router keeps sglang-router 0.3.2's worker API and routing policies."""

from __future__ import annotations

import asyncio
import collections
import uuid

import httpx
import pytest
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.fake_sglang.mock_router import ROUTING_KEY_HEADER, Router, build_router_app, worker_id_for
from sim.fake_sglang.testing import launch_fake_sglang
from tests.hypothesis_budget import examples

pytestmark = pytest.mark.cpu

URLS = [f"http://127.0.0.1:{30000 + i}" for i in range(8)]


@settings(max_examples=examples(200), deadline=None)
@given(
    n=st.integers(1, 8),
    keys=st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=30),
    drop=st.integers(0, 7),
)
def test_manual_policy_is_sticky_and_moves_only_removed_workers_keys(n, keys, drop):
    r = Router("manual")
    for u in URLS[:n]:
        r.add(u)
    first = {k: r.select(k).url for k in keys}
    assert all(r.select(k).url == first[k] for k in keys)  # sticky
    if n > 1:
        gone = URLS[drop % n]
        assert r.remove(worker_id_for(gone))
        for k in keys:
            if first[k] != gone:
                assert r.select(k).url == first[k]
            else:
                assert r.select(k).url != gone


@settings(max_examples=examples(200), deadline=None)
@given(n=st.integers(1, 8), rounds=st.integers(1, 5))
def test_round_robin_is_balanced(n, rounds):
    r = Router("round_robin")
    for u in URLS[:n]:
        r.add(u)
    counts = collections.Counter(r.select().url for _ in range(n * rounds))
    assert set(counts.values()) == {rounds}


def test_registry_json_shapes():
    r = Router("random")
    w = r.add(URLS[0])
    assert r.add(URLS[0] + "/").id == w.id  # same URL, same id
    r.add(URLS[1], worker_type="prefill", bootstrap_port=9000)
    j = r.list_json()
    assert j["total"] == 2 and j["stats"] == {"prefill_count": 1, "decode_count": 0, "regular_count": 1}
    assert {"id", "url", "worker_type", "is_healthy", "load"} <= set(j["workers"][0])
    assert all(r.select().url == URLS[0] for _ in range(10))  # prefill workers do not serve /generate


def test_http_surface_in_front_of_fake_servers(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("output_len: {dist: fixed, value: 3}\n")
    syn = ["--engine", "synthetic", "--synthetic-config", str(cfg)]
    with launch_fake_sglang(syn) as w1, launch_fake_sglang(syn) as w2:
        with launch_fake_sglang(
            ["--policy", "manual", "--worker-urls", w1.url], module="sim.fake_sglang.mock_router"
        ) as rt:
            c = httpx.Client(base_url=rt.url, timeout=30)
            assert c.get("/health").status_code == 200
            r = c.post("/workers", json={"url": w2.url, "worker_type": "regular"})
            assert r.status_code == 202 and r.json()["status"] == "accepted"
            wid = r.json()["worker_id"]
            assert c.get("/workers").json()["total"] == 2
            seen = collections.defaultdict(set)
            for key in ["a", "b", "c", "d", "a", "b", "c", "d"]:
                resp = c.post("/generate", headers={ROUTING_KEY_HEADER: key}, json={"input_ids": [1], "rid": key * 3})
                assert resp.status_code == 200 and len(resp.json()["output_ids"]) == 3
                seen[key].add(resp.headers["X-Mock-Router-Worker"])
            assert all(len(v) == 1 for v in seen.values())
            assert c.delete(f"/workers/{wid}").status_code == 202
            assert c.delete("/workers/not-a-uuid").status_code == 400
            assert c.post("/workers", json={"worker_type": "regular"}).status_code == 422
            assert [w["url"] for w in c.get("/workers").json()["workers"]] == [w1.url]
            assert c.delete(f"/workers/{worker_id_for(w1.url)}").status_code == 202
            resp = c.post("/generate", json={"input_ids": [1]})
            assert resp.status_code == 503 and resp.json()["error"]["code"] == "no_available_workers"
            c.close()


# Answers of the real sglang-router 0.3.2 binary to malformed input, observed on loopback (their "at line L column
# C" suffix left out: the mock does not compute serde's positions).
PARSE = "Failed to parse the request body as JSON: "
DATA = "Failed to deserialize the JSON body into the target type: "
J = {"Content-Type": "application/json"}
REAL_ROUTER_ANSWERS = [
    ("POST", "/workers", b'{"url": "http://x"}', {"Content-Type": "text/plain"}, 415,
     "Expected request with `Content-Type: application/json`"),
    ("POST", "/workers", b"not json", J, 400, PARSE),
    ("POST", "/workers", b"", J, 400, PARSE + "EOF while parsing a value at line 1 column 0"),
    ("POST", "/workers", b"{}", J, 422, DATA + "missing field `url`"),
    ("POST", "/workers", b'{"url": 5}', J, 422, DATA + "url: invalid type: integer `5`, expected a string"),
    ("POST", "/workers", b"[1, 2]", J, 422, DATA + "[0]: invalid type: integer `1`, expected a string"),
    ("POST", "/workers", b'"x"', J, 422, DATA + 'invalid type: string "x", expected struct WorkerConfigRequest'),
    ("POST", "/workers", b'{"url": "http://127.0.0.1:1", "bootstrap_port": "x"}', J, 422,
     DATA + 'bootstrap_port: invalid type: string "x", expected u16'),
    ("POST", "/workers", b'{"url": "http://127.0.0.1:1", "bootstrap_port": -1}', J, 422,
     DATA + "bootstrap_port: invalid value: integer `-1`, expected u16"),
    ("POST", "/workers", b'{"url": "\\ud800"}', J, 400, PARSE + "url: unexpected end of hex escape"),
    ("POST", "/generate", b'{"input_ids": "abc"}', J, 422,
     DATA + "input_ids: data did not match any variant of untagged enum InputIds"),
    ("POST", "/generate", b'{"text": "a", "sampling_params": 3}', J, 422,
     DATA + "sampling_params: invalid type: integer `3`, expected struct SamplingParams"),
    ("POST", "/generate", b'{"text": "a", "sampling_params": {"temperature": "x"}}', J, 422,
     DATA + 'sampling_params.temperature: invalid type: string "x", expected f32'),
    ("POST", "/generate", b'{"text": "a", "sampling_params": {"max_new_tokens": -1}}', J, 422,
     DATA + "sampling_params.max_new_tokens: invalid value: integer `-1`, expected u32"),
    ("POST", "/generate", b'{"input_ids": [1], "sampling_params": [{}]}', J, 422,
     DATA + "sampling_params[0]: invalid type: map, expected f32"),
    ("POST", "/generate", b'{"input_ids": [1], "sampling_params": {"stop": 3}}', J, 422,
     DATA + "sampling_params.stop: data did not match any variant of untagged enum StringOrArray"),
    ("POST", "/generate", b'{"input_ids": [1], "sampling_params": {"stop_token_ids": [-1]}}', J, 422,
     DATA + "sampling_params.stop_token_ids[0]: invalid value: integer `-1`, expected u32"),
    ("POST", "/generate", b'{"input_ids": [1], "stream": 1}', J, 422,
     DATA + "stream: invalid type: integer `1`, expected a boolean"),
    ("POST", "/generate", b'{"input_ids": [1], "input_ids": [2]}', J, 422, DATA + "duplicate field `input_ids`"),
    ("POST", "/generate", b'{"input_ids": [1]} x', J, 400, PARSE + "trailing characters at line 1 column 20"),
    ("POST", "/generate", b'{"input_ids": [1], "x": NaN}', J, 400, PARSE),
    ("POST", "/generate", b'{"text": "\\ud800"}', J, 400, PARSE + "text: unexpected end of hex escape"),
    ("GET", "/workers/not-a-uuid", b"", {}, 400,
     '{"error": "Invalid worker_id \'not-a-uuid\' (expected UUID). Error: invalid character: expected an optional '
     'prefix of `urn:uuid:` followed by [0-9a-fA-F-], found `n` at 1", "code": "BAD_REQUEST"}'),
    ("DELETE", f"/workers/{uuid.UUID(int=0)}", b"", {}, 404,
     f'{{"error": "Worker {uuid.UUID(int=0)} not found", "code": "WORKER_NOT_FOUND"}}'),
    ("GET", "/generate", b"", {}, 405, ""),
    ("GET", "/no_such_route", b"", {}, 404, ""),
    # what the real router takes: unknown fields, null optionals, a worker type it does not know
    ("POST", "/generate", b'{"input_ids": [-1], "sampling_params": null, "routing_key": 3, "x": [[[]]]}', J, 503,
     '{"error": {"type": "Service Unavailable", "code": "no_available_workers"'),
    ("POST", "/workers", b'{"url": "http://127.0.0.1:1", "worker_type": "bogus"}', J, 202, '{"status": "accepted"'),
]  # fmt: skip


def test_malformed_bodies_get_the_real_routers_answers():
    async def answers() -> list[tuple[int, str]]:
        out = []
        async with TestClient(TestServer(build_router_app(Router()), host="127.0.0.1")) as c:
            for method, path, body, headers, *_ in REAL_ROUTER_ANSWERS:
                async with c.request(method, path, data=body, headers=headers) as r:
                    out.append((r.status, await r.text()))
        return out

    for (method, path, body, _, status, text), got in zip(REAL_ROUTER_ANSWERS, asyncio.run(answers()), strict=True):
        assert got[0] == status and got[1].startswith(text) and (text or not got[1]), (method, path, body, got)
