"""The mock router keeps sglang-router 0.3.2's worker API and routing policies."""

from __future__ import annotations

import collections

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.fake_sglang.mock_router import ROUTING_KEY_HEADER, Router, worker_id_for
from sim.fake_sglang.testing import launch_fake_sglang

pytestmark = pytest.mark.cpu

URLS = [f"http://127.0.0.1:{30000 + i}" for i in range(8)]


@settings(max_examples=200, deadline=None)
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


@settings(max_examples=200, deadline=None)
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


@pytest.mark.xdist_group("cluster")
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
