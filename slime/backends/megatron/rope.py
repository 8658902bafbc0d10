"""RoPE angles from per-token positions for slime's packed rows.

Why: megatron-core 0.16.1's GPTModel computes rotary angles for positions 0..max_seqlen-1 and its THD path
restarts them at every `cu_seqlens` boundary. A branch of a shared prompt (packing.py) continues after the
prompt instead, so its positions are not where its segment starts. This wrapper around the model's
`RotaryEmbedding` returns one angle row per token, indexed by the row's `_slime_positions`; megatron's THD
RoPE applies such a per-token table as is (the "exact mapping" case of `_apply_rotary_pos_emb_thd`, taken
when the table has one row per token). Calls without slime's positions fall through unchanged.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)


class PositionalRotaryEmbedding(torch.nn.Module):
    """Stands in for `GPTModel.rotary_pos_emb`; holds no parameters or buffers (state dicts are unchanged)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self._params: Any = None  # the PackedSeqParams of the forward in progress

    def get_rotary_seq_len(
        self,
        inference_context: Any,
        transformer: Any,
        transformer_input: Any,
        config: Any,
        packed_seq_params: Any = None,
        **kw: Any,
    ) -> int:
        # GPTModel calls this right before forward(); it is the one call that sees the packed params.
        self._params = packed_seq_params
        return self.inner.get_rotary_seq_len(
            inference_context, transformer, transformer_input, config, packed_seq_params, **kw
        )

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group: Any = None) -> Any:
        params, self._params = self._params, None
        positions = getattr(params, "_slime_positions", None)
        if positions is None:
            return self.inner(max_seq_len, offset=offset, packed_seq=packed_seq, cp_group=cp_group)
        # positions < max_seqlen_q (packing.py sets it to the longest prompt + branch): no host sync on GPU
        table = self.inner(int(params.max_seqlen_q), packed_seq=True, cp_group=cp_group)  # [P, 1, 1, dim]
        params._slime_rope_applied = True
        return table.index_select(0, positions.to(table.device))

    def get_cos_sin(self, max_seq_len: int, offset: int = 0) -> Any:
        return self.inner.get_cos_sin(max_seq_len, offset)


def use_positional_rope(model: torch.nn.Module) -> None:
    """Wrap the GPTModel's rotary embedding (a no-op for models without one, e.g. middle pipeline stages)."""
    inner = getattr(model, "rotary_pos_emb", None)
    if inner is not None and not isinstance(inner, PositionalRotaryEmbedding):
        model.rotary_pos_emb = PositionalRotaryEmbedding(inner)
