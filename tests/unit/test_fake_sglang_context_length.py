"""The fake holds prompts to the model's context length as SGLang 0.5.17 does (tokenizer_manager.py
`_validate_one_request`): a prompt of at least the context length, or one whose max_new_tokens would not fit
after it, is a 400 `{"error": {"message": ...}}` in SGLang's words; `--context-length` overrides the config's,
and `/v1/models` lists it as `max_model_len`."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from sim.fake_sglang.testing import launch_fake_sglang

pytestmark = pytest.mark.cpu


def generate(url: str, n: int, **sampling: int) -> httpx.Response:
    body = {"input_ids": [5] * n, "sampling_params": {"max_new_tokens": 1, **sampling}}
    return httpx.post(f"{url}/generate", json=body, timeout=60)


@pytest.mark.parametrize("override", [None, 64])
def test_prompts_are_held_to_the_context_length(tmp_path: Path, override: int | None) -> None:
    from sim.tiny_checkpoint import build_tiny_checkpoint

    ckpt = build_tiny_checkpoint(tmp_path / "tiny")  # max_position_embeddings 4096
    (tmp_path / "script.json").write_text(json.dumps({"default": {"completion": "ok"}}))
    args = ["--engine", "scripted", "--script", str(tmp_path / "script.json"), "--model-path", str(ckpt)]
    ctx = override or 4096
    with launch_fake_sglang(args + (["--context-length", str(override)] if override else [])) as eng:
        assert httpx.get(f"{eng.url}/v1/models").json()["data"][0]["max_model_len"] == ctx
        too_long = generate(eng.url, ctx)
        assert too_long.status_code == 400
        assert too_long.json() == {
            "error": {"message": f"The input ({ctx} tokens) is longer than the model's context length ({ctx} tokens)."}
        }
        no_room = generate(eng.url, ctx - 10, max_new_tokens=11)
        assert no_room.status_code == 400
        assert no_room.json()["error"]["message"].startswith(
            f"Requested token count exceeds the model's maximum context length of {ctx} tokens. You requested a "
            f"total of {ctx + 1} tokens: {ctx - 10} tokens from the input messages and 11 tokens for the completion."
        )
        assert generate(eng.url, ctx - 10, max_new_tokens=10).status_code == 200
