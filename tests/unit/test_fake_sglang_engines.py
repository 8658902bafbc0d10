"""Scripted and synthetic engines, and clean shutdown of the server process."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest
import yaml

from sim.fake_sglang.scripted_engine import scripted_logprob
from sim.fake_sglang.testing import launch_fake_sglang
from sim.tiny_checkpoint import build_tiny_checkpoint

pytestmark = pytest.mark.cpu

TOOL_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("fs_eng") / "ckpt")


@pytest.fixture(scope="module")
def scripted(ckpt, tmp_path_factory):
    d = tmp_path_factory.mktemp("script")
    script = {
        "rules": [
            {"match": r"weather", "completion": TOOL_CALL},
            {"match": r"2\+2", "completion": "<think>\nadd\n</think>\n\n4"},
            {"match": r"essay", "completion": "word " * 20, "finish_reason": "length"},
        ],
        "default": {"completion": "I do not know."},
    }
    (d / "s.yaml").write_text(yaml.safe_dump(script))
    with launch_fake_sglang(["--engine", "scripted", "--model-path", str(ckpt), "--script", str(d / "s.yaml")]) as s:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            yield c


def chat(tok, text):
    return tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)


def test_scripted_rules_tokens_and_logprobs(scripted, ckpt):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpt)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    r = scripted.post("/generate", json={"text": chat(tok, "weather in Paris?"), "return_logprob": True}).json()
    assert r["text"] == TOOL_CALL
    assert r["output_ids"] == tok.encode(TOOL_CALL) + [eos]
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}
    lps = [lp for lp, _, _ in r["meta_info"]["output_token_logprobs"]]
    assert lps == [pytest.approx(scripted_logprob(t, i)) for i, t in enumerate(r["output_ids"])]
    assert all(lp < 0 for lp in lps) and len(set(lps)) > 1

    r = scripted.post("/generate", json={"text": chat(tok, "2+2?")}).json()
    assert r["text"] == "<think>\nadd\n</think>\n\n4"
    r = scripted.post("/generate", json={"text": chat(tok, "hi"), "sampling_params": {"max_new_tokens": 2}}).json()
    assert r["meta_info"]["finish_reason"] == {"type": "length", "length": 2}
    assert r["output_ids"] == tok.encode("I do not know.")[:2]
    r = scripted.post("/generate", json={"text": chat(tok, "an essay")}).json()
    assert r["meta_info"]["finish_reason"]["type"] == "length" and eos not in r["output_ids"]
    # Stop strings cut the text but keep the tokens produced.
    r = scripted.post("/generate", json={"text": chat(tok, "hi"), "sampling_params": {"stop": "not"}}).json()
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": "not"} and r["text"] == "I do "


def test_synthetic_lengths_follow_seeded_distribution(tmp_path):
    cfg = {
        "vocab_size": 100,
        "output_len": {"dist": "uniform", "low": 5, "high": 40},
        "token_latency_s": {"dist": "fixed", "value": 0.0},
    }
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    seeded = ["--enable-deterministic-inference"]  # SGLang ignores sampling_seed without it
    with launch_fake_sglang(["--engine", "synthetic", "--synthetic-config", str(tmp_path / "c.json"), *seeded]) as s:
        c = httpx.Client(base_url=s.url, timeout=60)

        def lens(seed_base):
            body = {
                "input_ids": [[1, 2]] * 16,
                "sampling_params": [{"max_new_tokens": 30, "sampling_seed": seed_base + i} for i in range(16)],
            }
            return [len(o["output_ids"]) for o in c.post("/generate", json=body).json()]  # fmt: skip

        a, b, other = lens(0), lens(0), lens(100)
        assert a == b and a != other
        assert all(5 <= n <= 30 for n in a) and 30 in a + other  # length cap hit for draws above 30
        outs = c.post(
            "/generate", json={"input_ids": [1], "sampling_params": {"max_new_tokens": 100, "sampling_seed": 3}}
        ).json()
        assert outs["meta_info"]["finish_reason"] == {"type": "stop", "matched": 0}
        c.close()


def test_sigterm_aborts_inflight_and_exits_zero(tmp_path):
    cfg = {"output_len": {"dist": "fixed", "value": 100000}, "token_latency_s": {"dist": "fixed", "value": 0.01}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    got = {}
    with launch_fake_sglang(["--engine", "synthetic", "--synthetic-config", str(tmp_path / "c.yaml")]) as s:

        def run():
            got["r"] = httpx.post(
                s.url + "/generate", json={"input_ids": [1], "sampling_params": {"max_new_tokens": 100000}}, timeout=60
            ).json()

        t = threading.Thread(target=run)
        t.start()
        while httpx.get(s.url + "/get_server_info").json()["internal_states"][0]["decode_steps"] < 5:
            time.sleep(0.02)
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(30) == 0
        t.join(30)
    assert got["r"]["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(got["r"]["output_ids"]) >= 5
