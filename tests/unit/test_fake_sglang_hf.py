"""The fake SGLang server with the `hf` engine, driven over plain HTTP exactly as SGLang is driven."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sim.fake_sglang.testing import launch_fake_sglang
from sim.fake_sglang.weights import build_update_body
from sim.tiny_checkpoint import build_tiny_checkpoint

pytestmark = pytest.mark.cpu


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("fs_hf") / "ckpt")


@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    log = tmp_path_factory.mktemp("fs_hf_log") / "requests.jsonl"
    args = ["--engine", "hf", "--model-path", str(ckpt), "--request-log", str(log), "--random-seed", "5"]
    args.append("--enable-deterministic-inference")  # the seeded tests below (SGLang ignores seeds without it)
    with launch_fake_sglang(args) as s:
        s.log = log
        with httpx.Client(base_url=s.url, timeout=60) as c:
            s.client = c
            yield s


def update(c: httpx.Client, body: dict) -> httpx.Response:
    """One `/update_weights_from_tensor` inside its own update session (SGLang 0.5.21+ loads only inside one)."""
    assert c.post("/begin_weight_update", json={}).json()["success"] is True
    try:
        return c.post("/update_weights_from_tensor", json=body)
    finally:
        assert c.post("/end_weight_update", json={}).json()["success"] is True


def gen(c: httpx.Client, **body) -> dict:
    r = c.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_ready_line_and_info_endpoints(server, ckpt):
    c = server.client
    assert server.ready_line == f"fake_sglang ready {server.url} engine=hf"
    assert c.get("/health").status_code == 200
    assert c.get("/health_generate").status_code == 200
    for path in ("/get_model_info", "/model_info"):
        info = c.get(path).json()
        assert info["model_path"] == str(ckpt) and info["is_generation"] is True
    for path in ("/get_server_info", "/server_info"):
        info = c.get(path).json()
        assert info["version"] == "0.5.23" and info["internal_states"][0]["engine"] == "hf"
    assert c.get("/model_info").json()["weight_version"] == "default"
    assert c.post("/flush_cache").status_code == 200


def test_logprobs_match_independent_teacher_forced_forward(server, ckpt):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpt)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], tokenize=False, add_generation_prompt=True
    )
    out = gen(
        server.client,
        text=prompt,
        sampling_params={"temperature": 0.7, "max_new_tokens": 24, "sampling_seed": 11, "ignore_eos": True},
        return_logprob=True,
    )
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 24}
    lps = meta["output_token_logprobs"]
    assert [t for _, t, _ in lps] == out["output_ids"] and all(x is None for _, _, x in lps)
    prompt_ids = tok.encode(prompt)
    assert meta["prompt_tokens"] == len(prompt_ids) and meta["completion_tokens"] == 24

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids + out["output_ids"]])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1]
    ref = torch.log_softmax(logits / 0.7, -1).gather(-1, torch.tensor(out["output_ids"])[:, None])[:, 0]
    assert torch.allclose(torch.tensor([lp for lp, _, _ in lps]), ref, atol=1e-5)


def test_sampling_seed_is_deterministic_regardless_of_batching(server):
    c = server.client
    sp = {"temperature": 1.0, "max_new_tokens": 12, "sampling_seed": 42, "ignore_eos": True}
    alone = gen(c, input_ids=[10, 20, 30], sampling_params=sp)
    batch = gen(
        c,
        input_ids=[[5, 6], [10, 20, 30], [7, 8, 9, 10, 11]],
        sampling_params=[dict(sp, sampling_seed=1), sp, dict(sp, sampling_seed=2)],
        rid="grp",
    )
    assert [b["meta_info"]["id"] for b in batch] == ["grp_0", "grp_1", "grp_2"]
    assert batch[1]["output_ids"] == alone["output_ids"]
    # Concurrent requests (continuous batching) give the same answer too.
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(gen(c, input_ids=[10, 20, 30], sampling_params=sp)))
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r["output_ids"] == alone["output_ids"] for r in results)
    other = gen(c, input_ids=[10, 20, 30], sampling_params=dict(sp, sampling_seed=43))
    assert other["output_ids"] != alone["output_ids"]


def _start_long(c: httpx.Client, rid: str, holder: dict, max_new_tokens: int = 4000) -> threading.Thread:
    def run():
        holder[rid] = gen(
            c, input_ids=[1, 2, 3], rid=rid, return_logprob=True,
            sampling_params={"max_new_tokens": max_new_tokens, "ignore_eos": True, "temperature": 1.0},
        )  # fmt: skip

    t = threading.Thread(target=run)
    t.start()
    return t


def _wait_running(c: httpx.Client, n: int) -> None:
    for _ in range(500):
        st = c.get("/get_server_info").json()["internal_states"][0]
        if st["num_running_reqs"] >= n and st["decode_steps"] > 3:
            return
        time.sleep(0.01)
    raise AssertionError("requests never started")


def test_abort_by_rid_and_abort_all_return_partial_tokens(server):
    c = server.client
    got: dict = {}
    t1, t2, t3 = _start_long(c, "a1", got), _start_long(c, "a2", got), _start_long(c, "a3", got)
    _wait_running(c, 3)
    # Held in place, so none can run to its length limit before the aborts arrive (the cached decode is fast).
    assert c.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
    try:
        assert c.post("/abort_request", json={"rid": "a1"}).status_code == 200
        t1.join(30)
        assert got["a1"]["meta_info"]["finish_reason"]["type"] == "abort"
        assert 0 < len(got["a1"]["output_ids"]) < 4000
        assert len(got["a1"]["meta_info"]["output_token_logprobs"]) == len(got["a1"]["output_ids"])
        assert "a2" not in got
        assert c.post("/abort_request", json={"abort_all": True}).status_code == 200
        t2.join(30)
        t3.join(30)
    finally:
        c.post("/continue_generation", json={})
    for rid in ("a2", "a3"):
        assert got[rid]["meta_info"]["finish_reason"]["type"] == "abort"
        assert 0 < len(got[rid]["output_ids"]) < 4000


def test_stream_is_cumulative_sse_ending_with_done(server):
    with server.client.stream(
        "POST",
        "/generate",
        json={"text": "Hello", "stream": True, "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}},
    ) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[len("data: ") :]) for ln in lines[:-1]]
    assert len(chunks) == 6
    for i, ch in enumerate(chunks):
        assert len(ch["output_ids"]) == i + 1
        assert ch["output_ids"][:i] == chunks[-1]["output_ids"][:i]  # cumulative
        assert (
            ch["meta_info"]["finish_reason"] is None if i < 5 else ch["meta_info"]["finish_reason"]["type"] == "length"
        )


def test_pause_in_place_holds_running_and_new_requests_then_continue(server, ckpt):
    from safetensors.torch import load_file

    c = server.client
    got: dict = {}
    t = _start_long(c, "p1", got, max_new_tokens=300)
    _wait_running(c, 1)
    r = c.post("/pause_generation", json={"mode": "in_place"})
    assert r.status_code == 200 and r.json()["status"] == "ok"
    steps = c.get("/get_server_info").json()["internal_states"][0]["decode_steps"]
    t_new = _start_long(c, "p2", got, max_new_tokens=3)
    time.sleep(0.3)
    st = c.get("/get_server_info").json()["internal_states"][0]
    assert st["decode_steps"] == steps and st["paused"] and "p1" not in got and "p2" not in got
    assert c.post("/flush_cache").status_code == 400  # requests still in the engine
    # an update that asks for a flush then fails as loudly as SGLang's scheduler (an assert); without one it loads
    same = list(load_file(str(ckpt / "model.safetensors")).items())[:2]  # the served values: outputs unchanged
    answers = {}
    for flush in (True, False):
        body, _keep = build_update_body(same, flush_cache=flush)
        answers[flush] = update(c, body)
    assert answers[True].status_code == 500, answers[True].text
    assert answers[True].json()["error"]["message"] == "Cache flush failed after updating weights"
    assert answers[False].status_code == 200 and answers[False].json()["success"] is True
    assert c.post("/continue_generation", json={}).status_code == 200
    t.join(60)
    t_new.join(60)
    assert got["p1"]["meta_info"]["finish_reason"] == {"type": "length", "length": 300}
    assert len(got["p2"]["output_ids"]) == 3
    # Default mode is "abort": running requests come back aborted; continue resumes service.
    t = _start_long(c, "p3", got)
    _wait_running(c, 1)
    assert c.post("/pause_generation", json={}).status_code == 200
    t.join(30)
    assert got["p3"]["meta_info"]["finish_reason"]["type"] == "abort"
    assert c.post("/pause_generation", json={"mode": "bogus"}).status_code == 400
    c.post("/continue_generation", json={})
    assert gen(c, input_ids=[1], sampling_params={"max_new_tokens": 2})["meta_info"]["completion_tokens"] >= 1


@pytest.mark.parametrize("load_format", [None, "flattened_bucket"])
def test_update_weights_from_tensor_changes_outputs_and_version(server, ckpt, load_format):
    from safetensors.torch import load_file

    c = server.client
    sp = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
    before = gen(c, input_ids=[3, 4, 5], sampling_params=sp)
    original = load_file(str(ckpt / "model.safetensors"))
    g = torch.Generator().manual_seed(99)
    new = [
        (n, torch.randn(t.shape, generator=g) * 0.5) for n, t in original.items() if "layers.1." in n or "embed" in n
    ]
    body, keep = build_update_body(new, load_format=load_format, weight_version="v7")
    assert c.post("/update_weights_from_tensor", json=body).status_code == 400  # outside a session (0.5.21+)
    r = update(c, body)
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    after = gen(c, input_ids=[3, 4, 5], sampling_params=sp)
    assert after["meta_info"]["weight_version"] == "v7"
    assert after["output_ids"] != before["output_ids"]
    assert c.get("/model_info").json()["weight_version"] == "v7"
    # Restore the original weights (other tests share this server) and check outputs come back exactly.
    body, keep = build_update_body(list(original.items()), load_format=load_format, weight_version="default")
    assert update(c, body).json()["success"] is True
    assert gen(c, input_ids=[3, 4, 5], sampling_params=sp)["output_ids"] == before["output_ids"]
    del keep
    bad, _k = build_update_body([("no.such.param", torch.zeros(2))], weight_version="bad")
    r = update(c, bad)
    assert r.status_code == 400 and r.json()["success"] is False
    assert c.get("/model_info").json()["weight_version"] == "default"


def test_update_weights_from_disk_and_release_resume(server, ckpt):
    c = server.client
    r = c.post("/update_weights_from_disk", json={"model_path": str(ckpt), "weight_version": "disk1"})
    assert r.status_code == 200 and r.json()["success"] is True and r.json()["num_paused_requests"] == 0
    assert c.get("/model_info").json()["weight_version"] == "disk1"
    assert c.post("/release_memory_occupation", json={"tags": ["kv_cache", "weights"]}).status_code == 200
    r = c.post("/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 400 and "released" in r.json()["error"]["message"]
    assert c.post("/resume_memory_occupation", json={"tags": ["kv_cache", "weights"]}).status_code == 200
    assert gen(c, input_ids=[1, 2], sampling_params={"max_new_tokens": 2})["meta_info"]["weight_version"] == "disk1"
    c.post("/update_weight_version", json={"new_version": "default"})


def test_stop_strings_stop_token_ids_and_request_log(server, ckpt):
    from safetensors.torch import load_file

    c = server.client
    # An update of its own (the served weights again): the module-scoped server may be fresh when xdist
    # interleaves modules, so the log cannot rely on another test's update.
    body, keep = build_update_body(list(load_file(str(ckpt / "model.safetensors")).items()), weight_version="default")
    assert update(c, body).json()["success"] is True
    del keep
    first = gen(c, input_ids=[3, 4, 5], sampling_params={"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True})
    stop_id = first["output_ids"][2]
    out = gen(
        c, input_ids=[3, 4, 5], sampling_params={"temperature": 0.0, "max_new_tokens": 6, "stop_token_ids": [stop_id]}
    )
    idx = first["output_ids"].index(stop_id)
    assert out["output_ids"] == first["output_ids"][: idx + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    # Bad requests answer 400 with SGLang's error shape.
    r = c.post("/generate", json={"sampling_params": {}})
    assert r.status_code == 400 and "error" in r.json()
    records = [json.loads(line) for line in server.log.read_text().splitlines()]
    gens = [r for r in records if r["endpoint"] == "/generate" and r.get("responses")]
    assert gens and all(
        {"rid", "output_ids", "finish_reason", "weight_version"} <= set(g["responses"][0]) for g in gens
    )
    assert any(r["endpoint"] == "/update_weights_from_tensor" and "tensor_names" in r for r in records)
    assert all("serialized_named_tensors" not in r.get("body", {}) for r in records)


@pytest.fixture(scope="module")
def cache_pair(ckpt):
    """Two engines on the checkpoint, one without the KV cache, and their initial weights (loaded once: each
    example below starts from them with an empty cache)."""
    from sim.fake_sglang.hf_engine import HFEngine

    cached, full = (HFEngine(model_path=str(ckpt)) for _ in range(2))
    full.kv_cache = False
    return cached, full, {k: v.clone() for k, v in cached.model.state_dict().items()}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_kv_cache_gives_the_logits_of_full_recompute(cache_pair, data):
    """Continuous batching with the cache: joins (siblings of one prompt among them), finishes, aborts and
    retracted-then-resumed requests (whose held tokens no longer match) give the next-token logits of recomputing
    every sequence, and a weight update drops it."""
    from sim.fake_sglang.protocol import GenRequest, SamplingParams

    cached, full, initial = cache_pair
    for m in (cached.model, full.model):
        m.load_state_dict(initial)
    cached._kv = full._kv = None
    running: list[GenRequest] = []
    for step in range(data.draw(st.integers(3, 10), label="steps")):
        running = [r for r in running if not data.draw(st.booleans(), label="leave")]
        for k in range(data.draw(st.integers(0 if running else 1, 3), label="joins")):
            prompt = data.draw(st.lists(st.integers(3, 300), min_size=1, max_size=9), label="prompt")
            if k and data.draw(st.booleans(), label="sibling"):  # n samples of one prompt: prefilled once
                prompt = list(running[-1].prompt_ids)
            running.append(GenRequest(rid=f"r{step}_{k}", prompt_ids=prompt, params=SamplingParams()))
        if running and data.draw(st.booleans(), label="retract one"):
            running[0].output_ids = running[0].output_ids[:-1]  # held tokens no longer match: re-prefilled
        if data.draw(st.integers(0, 9), label="weights") == 0:
            with torch.no_grad():
                for m in (cached.model, full.model):
                    m.model.norm.weight.mul_(1.01)
            cached._kv = None  # what load_named_tensors does under the step lock
        want = full._batch_logits(running)
        torch.testing.assert_close(cached._batch_logits(running), want, atol=2e-5, rtol=1e-5)
        assert sorted(cached._kv.rids) == sorted(r.rid for r in running)
        for r, row in zip(running, want, strict=True):
            r.output_ids.append(int(row.argmax()))
    assert cached.kv_cache
