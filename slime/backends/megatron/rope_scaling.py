"""RoPE scaling (`linear`, `dynamic`, `yarn`, `llama3`) with the inverse frequencies HF computes.

Why: megatron-core 0.16.1's `RotaryEmbedding` knows Llama 3's scaling only with fixed factors and YaRN only as
MLA's embedding, and neither matches every field a checkpoint's `rope_parameters` can set. The checkpoints users
bring (Llama 3.1-3.3, Qwen2.5 long-context) are defined by HF's `modeling_rope_utils`, so slime calls the same
`ROPE_INIT_FUNCTIONS` on the checkpoint's own config: the inverse frequencies are HF's bit for bit, and the
attention factor (YaRN's mscale; 1 for the others) multiplies cos and sin as HF's rotary embedding does
(`rope.apply_packed_rope` reads it from the model's `TransformerConfig`).

`dynamic` (NTK-aware) recomputes the frequencies from the sequence length when it exceeds
`max_position_embeddings`. HF takes the longest position of the forward (max(position_ids) + 1 over the batch);
slime takes it over the packed row, so a row equals HF's forward of the same samples as one batch, and a sample
alone in its row equals HF on that sample. (HF additionally keeps the longest length seen so far between calls;
a fresh HF model, as the tests use, does not depend on that history.)
"""

from __future__ import annotations

import functools
import json
import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=8)
def _hf_config(fields: str) -> Any:
    from transformers import AutoConfig

    d = json.loads(fields)
    return AutoConfig.for_model(d.pop("model_type"), **d)


def hf_rope_type(fields: str) -> str:
    """The rope type as transformers reads the config (v4's flat `rope_scaling` and v5's `rope_parameters`)."""
    return str(_hf_config(fields).rope_parameters.get("rope_type", "default"))


def inv_freq_and_attention_factor(fields: str, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """HF's inverse frequencies (float32, CPU) and cos/sin factor for the checkpoint's RoPE at `seq_len`."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = _hf_config(fields)
    kw = {"seq_len": seq_len} if seq_len is not None else {}
    inv_freq, factor = ROPE_INIT_FUNCTIONS[hf_rope_type(fields)](config, torch.device("cpu"), **kw)
    return inv_freq.float(), float(factor)


class ScaledRope:
    """Angle tables [T, 1, 1, dim] (megatron's non-interleaved layout) for per-token positions."""

    def __init__(self, fields: str) -> None:
        self.fields = fields
        self.rope_type = hf_rope_type(fields)
        self._static, self.attention_factor = inv_freq_and_attention_factor(fields)

    def inv_freq(self, positions: torch.Tensor) -> torch.Tensor:
        if self.rope_type != "dynamic":
            return self._static
        seq_len = int(positions.max().item()) + 1 if positions.numel() else 0  # one host sync, dynamic only
        return inv_freq_and_attention_factor(self.fields, seq_len)[0]

    def table(self, positions: torch.Tensor) -> torch.Tensor:
        inv = self.inv_freq(positions).to(positions.device)
        freqs = positions[:, None].float() * inv  # as HF: position_ids[..., None].float() * inv_freq
        return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]
