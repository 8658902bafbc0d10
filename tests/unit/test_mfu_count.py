"""`bench/mfu.py` counts what the GPU multiplies: checked against torch's own FLOP counter over a tiny Qwen2's
forward + backward (the input embedding's lookup and backward are no matmul; the output projection is)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from bench.mfu import train_flops

pytestmark = pytest.mark.cpu


@pytest.mark.parametrize("tied", [False, True])
def test_train_flops_equal_torch_counted_matmuls(tied: bool) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hidden, layers, vocab, seq = 64, 3, 512, 48
    cfg = Qwen2Config(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=128, vocab_size=vocab, tie_word_embeddings=tied, attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    not_matmul = sum(p.numel() for n, p in model.named_parameters() if n.endswith("bias") or "norm" in n)
    ids = torch.randint(0, vocab, (1, seq))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    # eager attention multiplies the whole s x s score matrix (the causal mask is added, not skipped): twice the
    # causal count; norms and biases are parameters, not matmuls
    expected = (
        train_flops(n_params, vocab=vocab, hidden=hidden, layers=layers, sample_len=seq, tokens=seq, tied=tied)
        - 6 * not_matmul * seq
        + 6 * layers * hidden * seq * seq
    )
    assert counter.get_total_flops() == expected


def test_embedding_is_not_counted_when_untied() -> None:
    kw = {"vocab": 1000, "hidden": 10, "layers": 2, "sample_len": 8, "tokens": 8}
    assert train_flops(50_000, **kw, tied=True) - train_flops(50_000, **kw) == 6 * 1000 * 10 * 8
