"""What the fake's `/generate` answers carry beyond the tokens, as the 0.5.17 recording showed SGLang's do
(tests/fixtures/sglang-0.5.17/): `sampling_seed` only under `--enable-deterministic-inference`, the prefix cache's
`cached_tokens` / `cached_tokens_details`, `num_retractions`, the two forms of an aborted answer, and where
`e2e_latency` / `response_sent_to_client_ts` appear in a stream."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import yaml

from sim.fake_sglang.testing import launch_fake_sglang

pytestmark = pytest.mark.cpu

SEEDED = {"temperature": 1.0, "max_new_tokens": 16, "ignore_eos": True, "sampling_seed": 1234}


def _synthetic(tmp_path, *extra: str, **cfg):
    path = tmp_path / f"c{len(list(tmp_path.iterdir()))}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return launch_fake_sglang(["--engine", "synthetic", "--synthetic-config", str(path), *extra])


def _gen(url: str, **body) -> dict:
    r = httpx.post(url + "/generate", json={"input_ids": [1, 2, 3, 4], **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _busy(url: str) -> int:
    state = httpx.get(url + "/server_info").json()["internal_states"][0]
    return state["num_running_reqs"] + state["num_waiting_reqs"]


def test_sampling_seed_is_honoured_only_with_deterministic_inference(tmp_path):
    """sampling_batch_info.py: `sampling_seed = ... if enable_deterministic else None`, and a request without a seed
    is sampled with seed 42 in that mode (recorded from 0.5.17 without the flag: the same seed, other tokens)."""
    with _synthetic(tmp_path) as s:
        first, second = (_gen(s.url, sampling_params=SEEDED)["output_ids"] for _ in range(2))
        assert first != second
        assert httpx.get(s.url + "/server_info").json()["enable_deterministic_inference"] is False
    with _synthetic(tmp_path, "--enable-deterministic-inference") as s:
        first, second = (_gen(s.url, sampling_params=SEEDED)["output_ids"] for _ in range(2))
        assert first == second
        other = _gen(s.url, sampling_params=dict(SEEDED, sampling_seed=1235))["output_ids"]
        assert other != first
        unseeded = {k: v for k, v in SEEDED.items() if k != "sampling_seed"}
        assert (
            _gen(s.url, sampling_params=unseeded)["output_ids"]
            == _gen(s.url, sampling_params=dict(unseeded, sampling_seed=42))["output_ids"]
        )


def test_cached_tokens_follow_the_prefix_cache(tmp_path):
    """output_streamer.py `get_cached_tokens_details`: null without a hit, `{device, host}` with one; a prompt
    matches at most len - 1 tokens, and no further than a logprob_start_len; flush_cache empties the cache."""
    sp = {"max_new_tokens": 2, "ignore_eos": True}
    with _synthetic(tmp_path) as s:
        meta = _gen(s.url, sampling_params=sp)["meta_info"]
        assert (meta["cached_tokens"], meta["cached_tokens_details"]) == (0, None)
        meta = _gen(s.url, sampling_params=sp)["meta_info"]
        assert (meta["cached_tokens"], meta["cached_tokens_details"]) == (3, {"device": 3, "host": 0})
        meta = _gen(s.url, sampling_params=sp, return_logprob=True, logprob_start_len=1)["meta_info"]
        assert meta["cached_tokens"] == 1
        out = _gen(s.url, input_ids=[1, 2, 9, 9, 9], sampling_params=sp)["meta_info"]
        assert out["cached_tokens"] == 2
        assert httpx.post(s.url + "/flush_cache").status_code == 200
        assert _gen(s.url, sampling_params=sp)["meta_info"]["cached_tokens_details"] is None


def test_meta_info_fields_and_the_stream_marks(tmp_path):
    """tokenizer_manager.py `_handle_batch_output` / `_wait_one_response`: every answer has num_retractions,
    reasoning_tokens, cached_tokens_details and dp_rank; e2e_latency only once finished; response_sent_to_client_ts
    on the first answer sent (a stream's first chunk only); output_token_logprobs_length with log-probs."""
    with _synthetic(tmp_path, token_latency_s={"dist": "fixed", "value": 0.02}) as s:
        meta = _gen(s.url, sampling_params={"max_new_tokens": 3, "ignore_eos": True}, return_logprob=True)["meta_info"]
        assert meta["num_retractions"] == 0 and meta["reasoning_tokens"] == 0 and meta["dp_rank"] is None
        assert meta["output_token_logprobs_length"] == 3 and meta["input_token_logprobs"] == []
        assert "e2e_latency" in meta and "response_sent_to_client_ts" in meta and "total_retractions" not in meta
        body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}, "stream": True}
        with httpx.stream("POST", s.url + "/generate", json=body, timeout=60) as r:
            lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
        assert lines[-1] == "[DONE]"
        chunks = [json.loads(c)["meta_info"] for c in lines[:-1]]
        assert len(chunks) >= 2 and chunks[-1]["completion_tokens"] == 4  # chunks may carry several tokens
        assert ["response_sent_to_client_ts" in c for c in chunks] == [True] + [False] * (len(chunks) - 1)
        assert ["e2e_latency" in c for c in chunks] == [False] * (len(chunks) - 1) + [True]


def test_aborts_answer_in_two_forms_and_retraction_is_counted(tmp_path):
    """scheduler.py `abort_request`: a running request answers "Aborted" with the full meta_info; one still waiting
    is answered by the tokenizer manager (`_handle_abort_req`): "Abort in waiting queue", no prompt_tokens. A pause
    in retract mode sends running requests back to the queue and counts it (num_retractions)."""
    cfg = {"output_len": {"dist": "fixed", "value": 100000}, "token_latency_s": {"dist": "fixed", "value": 0.005}}
    long = {"max_new_tokens": 100000, "ignore_eos": True}
    got: dict[str, dict] = {}
    with _synthetic(tmp_path, "--max-running-requests", "1", **cfg) as s:

        def run(rid: str) -> threading.Thread:
            t = threading.Thread(target=lambda: got.update({rid: _gen(s.url, rid=rid, sampling_params=long)}))
            t.start()
            return t

        threads = [run("running")]
        while _busy(s.url) < 1:
            time.sleep(0.01)
        threads.append(run("queued"))
        while _busy(s.url) < 2:
            time.sleep(0.01)
        assert httpx.post(s.url + "/pause_generation", json={"mode": "retract"}).status_code == 200
        assert httpx.post(s.url + "/continue_generation", json={}).status_code == 200
        time.sleep(0.05)
        assert httpx.post(s.url + "/abort_request", json={"abort_all": True}).status_code == 200
        for t in threads:
            t.join(30)
    running, queued = got["running"]["meta_info"], got["queued"]["meta_info"]
    assert running["finish_reason"] == {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
    assert running["num_retractions"] == 1 and running["prompt_tokens"] == 4
    assert running["completion_tokens"] == len(got["running"]["output_ids"]) > 0
    assert queued["finish_reason"] == {"type": "abort", "message": "Abort in waiting queue"}
    assert set(queued) == {"id", "finish_reason", "weight_version", "e2e_latency", "completion_tokens",
                           "response_sent_to_client_ts"}  # fmt: skip
