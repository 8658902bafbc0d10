"""Scoring a given sequence on the fake server: `/generate` with `max_new_tokens: 0`, `return_logprob` and
`logprob_start_len` (SGLang 0.5.23's `input_token_logprobs` / `input_top_logprobs`), and `/v1/chat/completions`.

The `hf` engine's numbers are checked against an independent fp32 HF forward; the shapes against SGLang's layout
(one entry per prompt token from `logprob_start_len` on, the first with a None log-prob).
"""

from __future__ import annotations

import httpx
import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sim.fake_sglang.sampling import scripted_logprob
from sim.fake_sglang.testing import launch_fake_sglang
from sim.tiny_checkpoint import build_tiny_checkpoint

pytestmark = pytest.mark.cpu


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("score") / "ckpt")


@pytest.fixture(scope="module")
def hf(ckpt):
    with (
        launch_fake_sglang(["--engine", "hf", "--model-path", str(ckpt)]) as s,
        httpx.Client(base_url=s.url, timeout=60) as c,
    ):
        yield c


@pytest.fixture(scope="module")
def scripted(ckpt, tmp_path_factory):
    script = tmp_path_factory.mktemp("score_script") / "s.yaml"
    script.write_text(yaml.safe_dump({"rules": [{"match": "judge", "completion": "score: 0.75"}]}))
    args = ["--engine", "scripted", "--model-path", str(ckpt), "--script", str(script)]
    with launch_fake_sglang(args) as s, httpx.Client(base_url=s.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def model(ckpt):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()


def score(c: httpx.Client, ids: list[int], **kw) -> dict:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 0, "temperature": kw.pop("temperature", 0.0)}}
    r = c.post("/generate", json={**body, "return_logprob": True, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def reference(model, ids: list[int], start: int, temperature: float = 1.0) -> torch.Tensor:
    """log p(ids[j] | ids[:j]) for j > start, from one plain fp32 HF forward."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits / temperature, -1)
    return torch.tensor([float(lp[j - 1, ids[j]]) for j in range(start + 1, len(ids))])


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_input_token_logprobs_equal_an_independent_hf_forward(hf, model, data):
    n = data.draw(st.integers(2, 40), label="length")
    ids = data.draw(st.lists(st.integers(0, model.config.vocab_size - 1), min_size=n, max_size=n), label="ids")
    start = data.draw(st.integers(0, n - 1), label="logprob_start_len")
    temperature = data.draw(st.sampled_from([0.0, 1.0, 0.7]), label="temperature")
    meta = score(hf, ids, logprob_start_len=start, temperature=temperature)["meta_info"]
    got = meta["input_token_logprobs"]
    assert len(got) == n - start and [t for _, t, _ in got] == ids[start:]
    assert got[0][0] is None and all(text is None for _, _, text in got)
    assert meta["output_token_logprobs"] == [] and meta["completion_tokens"] == 0
    assert meta["finish_reason"] == {"type": "length", "length": 0}
    want = reference(model, ids, start, temperature or 1.0)
    assert torch.allclose(torch.tensor([lp for lp, _, _ in got[1:]]), want, atol=1e-5, rtol=0)


def test_default_start_scores_no_prompt_token(hf):
    """scheduler.py `handle_generate_request` (every release): return_logprob with the default start (-1) scores
    the output only — the start becomes len(prompt) (recorded from 0.5.17: `input_token_logprobs: []`)."""
    meta = score(hf, [5, 6, 7, 8])["meta_info"]
    assert meta["input_token_logprobs"] == [] and meta["output_token_logprobs_length"] == 0
    meta = score(hf, [5, 6, 7, 8], top_logprobs_num=2)["meta_info"]
    assert meta["input_top_logprobs"] == [] and meta["output_top_logprobs"] == []


def test_top_logprobs_and_texts(hf, model, ckpt):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpt)
    ids = tok.encode("the cat sat on the mat")
    meta = score(hf, ids, logprob_start_len=1, top_logprobs_num=3, return_text_in_logprobs=True)["meta_info"]
    tops = meta["input_top_logprobs"]
    assert len(tops) == len(ids) - 1 and tops[0] is None and meta["output_top_logprobs"] == []
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    for j, top in enumerate(tops[1:], start=2):  # entry for token j: the distribution at position j - 1
        best = torch.topk(lp[j - 1], 3)
        assert [t for _, t, _ in top] == best.indices.tolist()
        assert torch.allclose(torch.tensor([v for v, _, _ in top]), best.values, atol=1e-5)
        assert [text for _, _, text in top] == [tok.decode([t]) for t in best.indices.tolist()]
    assert [text for _, _, text in meta["input_token_logprobs"]] == [tok.decode([t]) for t in ids[1:]]


def test_a_start_past_the_prompt_is_refused_and_one_at_its_end_scores_nothing(hf):
    body = {"input_ids": [1, 2, 3], "return_logprob": True, "sampling_params": {"max_new_tokens": 0}}
    r = hf.post("/generate", json={**body, "logprob_start_len": 4})
    assert r.status_code == 400 and "is higher than the number of input tokens" in r.json()["error"]["message"]
    assert score(hf, [1, 2, 3], logprob_start_len=3)["meta_info"]["input_token_logprobs"] == []


def test_top_logprobs_of_generated_tokens(hf, model):
    """top_logprobs_num with generation: one top-k per output token, from the distribution it was drawn from (its
    first entry is the greedy token itself; recorded from 0.5.17: `output_top_logprobs`)."""
    ids = [3, 4, 5, 6]
    r = hf.post(
        "/generate",
        json={
            "input_ids": ids,
            "return_logprob": True,
            "top_logprobs_num": 3,
            "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True},
        },
    )
    meta = r.json()["meta_info"]
    tops, out = meta["output_top_logprobs"], r.json()["output_ids"]
    assert len(tops) == len(out) == 4 and all(len(t) == 3 for t in tops)
    assert [t[0][1] for t in tops] == out
    assert [t[0][0] for t in tops] == [lp for lp, _, _ in meta["output_token_logprobs"]]
    with torch.no_grad():
        want = torch.topk(torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1), 3)
    assert [t for _, t, _ in tops[0]] == want.indices.tolist()
    assert torch.allclose(torch.tensor([v for v, _, _ in tops[0]]), want.values, atol=1e-5)


def test_batched_scoring_rows_are_independent(hf, model):
    rows = [[3, 4, 5, 6, 7], [9, 8], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
    r = hf.post("/generate", json={"input_ids": rows, "return_logprob": True, "logprob_start_len": [0, 0, 4],
                                   "sampling_params": {"max_new_tokens": 0}})  # fmt: skip
    assert r.status_code == 200, r.text
    for out, ids, start in zip(r.json(), rows, [0, 0, 4], strict=True):
        got = [lp for lp, _, _ in out["meta_info"]["input_token_logprobs"][1:]]
        assert torch.allclose(torch.tensor(got), reference(model, ids, start), atol=1e-5, rtol=0)


def test_scripted_engine_scores_deterministically(scripted):
    ids = [11, 12, 13, 14, 15, 16]
    a = score(scripted, ids, logprob_start_len=2)["meta_info"]["input_token_logprobs"]
    assert a == [[None, 13, None]] + [[pytest.approx(scripted_logprob(t, p)), t, None] for p, t in
                                      enumerate(ids) if p > 2]  # fmt: skip
    assert score(scripted, ids, logprob_start_len=2)["meta_info"]["input_token_logprobs"] == a
    top = score(scripted, ids, logprob_start_len=4, top_logprobs_num=2)["meta_info"]["input_top_logprobs"]
    assert top[0] is None and len(top) == 2 and len(top[1]) == 2 and top[1][0][0] >= top[1][1][0]
    assert top[1][0][0] == pytest.approx(-0.05)  # the formula's maximum is reached by some token at each position


def test_chat_completions_answers_like_sglang(scripted):
    body = {"model": "judge", "messages": [{"role": "user", "content": "judge this"}], "max_tokens": 16,
            "temperature": 0}  # fmt: skip
    r = scripted.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-")
    choice = out["choices"][0]
    # 0.5.22+ drops tool_calls when there are none; 0.5.23 adds completion_tokens_details (openai/protocol.py)
    assert choice["message"] == {"role": "assistant", "content": "score: 0.75", "reasoning_content": None}
    assert choice["finish_reason"] == "stop"
    assert out["usage"]["total_tokens"] == out["usage"]["prompt_tokens"] + out["usage"]["completion_tokens"]
    assert out["usage"]["prompt_tokens_details"] is None and out["usage"]["reasoning_tokens"] == 0
    assert out["usage"]["completion_tokens_details"] is None
    short = scripted.post("/v1/chat/completions", json={**body, "max_tokens": 2}).json()
    assert short["choices"][0]["finish_reason"] == "length" and short["usage"]["completion_tokens"] == 2
    bad = scripted.post("/v1/chat/completions", json={"messages": []})
    assert bad.status_code == 400 and bad.json()["object"] == "error"
    assert scripted.post("/v1/chat/completions", json={**body, "stream": True}).status_code == 400
