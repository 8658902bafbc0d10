"""The tiny checkpoint loads through the ordinary HF path and its chat template renders agent turns."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from sim.tiny_checkpoint import MAX_VOCAB, STAMP_NAME, build_tiny_checkpoint

pytestmark = pytest.mark.cpu

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")


def test_round_trip_auto_classes(ckpt):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(ckpt)
    model = AutoModelForCausalLM.from_pretrained(ckpt)
    assert len(tok) <= MAX_VOCAB
    assert model.config.vocab_size == len(tok)
    assert model.config.model_type == "qwen2"
    assert model.dtype == torch.float32
    # Qwen2 has biases on q/k/v only.
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.bias is not None and attn.k_proj.bias is not None and attn.v_proj.bias is not None
    assert attn.o_proj.bias is None
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    gen = GenerationConfig.from_pretrained(ckpt)
    assert set(gen.eos_token_id) == {
        tok.convert_tokens_to_ids("<|im_end|>"),
        tok.convert_tokens_to_ids("<|endoftext|>"),
    }
    ids = tok("The answer is 42.", return_tensors="pt").input_ids
    logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], len(tok))
    assert torch.isfinite(logits).all()


def test_tokenizer_agrees_with_raw_tokenizers_and_round_trips(ckpt):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpt)
    raw = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    for text in [
        "Hello world! 123 café 😀",
        '<tool_call>\n{"name": "f"}\n</tool_call>',
        "<|im_start|>user\nhi<|im_end|>",
    ]:
        ids = tok(text).input_ids
        assert ids == raw.encode(text).ids
        assert tok.decode(ids) == text
    # Markers are single, non-special tokens (they survive skip_special_tokens); chat delimiters are special.
    for marker in ["<tool_call>", "</tool_call>", "<think>", "</think>", "<tool_response>", "</tool_response>"]:
        ids = tok(marker).input_ids
        assert len(ids) == 1
        assert tok.decode(ids, skip_special_tokens=True) == marker
    assert tok.decode(tok("<|im_start|>a<|im_end|><|endoftext|>").input_ids, skip_special_tokens=True) == "a"


def test_chat_template_tools_tool_calls_think(ckpt):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpt)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "I should call the tool.",
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": "18C"},
    ]
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    tools_block = text.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0]
    assert json.loads(tools_block) == tools[0]
    assert "<think>\nI should call the tool.\n</think>\n\n" in text
    call = text.split("<tool_call>\n")[-1].split("\n</tool_call>")[0]
    assert json.loads(call) == {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert "<|im_start|>user\n<tool_response>\n18C\n</tool_response><|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    # String arguments (OpenAI wire format) are emitted verbatim; no tools => no tools block.
    plain = tok.apply_chat_template(
        [
            {"role": "user", "content": "x"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"function": {"name": "f", "arguments": '{"a": 1}'}}],
            },
        ],
        tokenize=False,
    )
    assert "<tools>" not in plain
    assert '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call><|im_end|>' in plain
    assert plain.startswith("<|im_start|>user\nx<|im_end|>\n")


def test_determinism_by_seed_and_idempotence(ckpt, tmp_path):
    a = load_file(str(ckpt / "model.safetensors"))
    same = load_file(str(build_tiny_checkpoint(tmp_path / "same", seed=0) / "model.safetensors"))
    other = load_file(str(build_tiny_checkpoint(tmp_path / "other", seed=1) / "model.safetensors"))
    assert a.keys() == same.keys() == other.keys()
    assert all(torch.equal(a[k], same[k]) for k in a)
    assert any(not torch.equal(a[k], other[k]) for k in a)
    assert (tmp_path / "same" / "tokenizer.json").read_text() == (ckpt / "tokenizer.json").read_text()

    # A second call with the same parameters reuses the files (mtime unchanged); new parameters rebuild.
    st = tmp_path / "same" / "model.safetensors"
    before = st.stat().st_mtime_ns
    build_tiny_checkpoint(tmp_path / "same", seed=0)
    assert st.stat().st_mtime_ns == before
    build_tiny_checkpoint(tmp_path / "same", seed=2)
    assert json.loads((tmp_path / "same" / STAMP_NAME).read_text())["seed"] == 2
    assert not torch.equal(load_file(str(st))["model.embed_tokens.weight"], same["model.embed_tokens.weight"])
