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

from slime.utils.cuda_compile import cuda_compiled

logger = logging.getLogger(__name__)


class PositionalRotaryEmbedding(torch.nn.Module):
    """Stands in for `GPTModel.rotary_pos_emb`; holds no parameters or buffers (state dicts are unchanged)."""

    def __init__(self, inner: torch.nn.Module, scaled: Any = None) -> None:
        super().__init__()
        self.inner = inner
        self.scaled = scaled  # a rope_scaling.ScaledRope: HF's frequencies replace megatron's table
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
        if positions is None and self.scaled is not None:
            if cp_group is not None and cp_group.size() > 1 and not packed_seq:
                raise NotImplementedError("scaled RoPE under CP needs slime's packed rows")
            device = self.inner.inv_freq.device
            return self.scaled.table(torch.arange(max_seq_len, device=device) + offset)
        if positions is None:
            return self.inner(max_seq_len, offset=offset, packed_seq=packed_seq, cp_group=cp_group)
        if self.scaled is not None:
            params._slime_rope_applied = True
            return self.scaled.table(positions.to(self.inner.inv_freq.device))
        # positions < max_seqlen_q (packing.py sets it to the longest prompt + branch): no host sync on GPU
        table = self.inner(int(params.max_seqlen_q), packed_seq=True, cp_group=cp_group)  # [P, 1, 1, dim]
        params._slime_rope_applied = True
        return table.index_select(0, positions.to(table.device))

    def get_cos_sin(self, max_seq_len: int, offset: int = 0) -> Any:
        return self.inner.get_cos_sin(max_seq_len, offset)


def use_positional_rope(model: torch.nn.Module, scaled: Any = None) -> None:
    """Wrap the GPTModel's rotary embedding (a no-op for models without one, e.g. middle pipeline stages);
    `scaled` (a `rope_scaling.ScaledRope`) supplies HF's frequencies for a scaled RoPE."""
    use_packed_rope()
    inner = getattr(model, "rotary_pos_emb", None)
    if inner is not None and not isinstance(inner, PositionalRotaryEmbedding):
        model.rotary_pos_emb = PositionalRotaryEmbedding(inner, scaled)


# --- applying the per-token table -------------------------------------------------------------------------------
#
# megatron's unfused THD RoPE (`_apply_rotary_pos_emb_thd`) splits the row at its `cu_seqlens` and reads every
# segment's start with `.item()` (a host sync for q and for k in every layer), re-concatenates the table, then
# recomputes cos and sin of all of it. For a per-token table on one CP rank the split changes nothing: the table's
# rows are the row's tokens in order. `apply_packed_rope` takes that case: cos/sin once per forward, no host sync,
# and on CUDA one compiled kernel per direction instead of megatron's six. Every other case is megatron's own code.

_megatron_apply_rotary_pos_emb: Any = None
_cos_sin_cache: dict[str, Any] = {}


@cuda_compiled
def _rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # megatron's non-interleaved formula, op for op: t·cos + rotate_half(t)·sin (one kernel on CUDA)
    x1, x2 = torch.chunk(t, 2, dim=-1)
    return (t * cos) + (torch.cat((-x2, x1), dim=-1) * sin)


def _cos_sin(freqs: torch.Tensor, mscale: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of this forward's table, computed once for all layers (q and k, forward and recompute)."""
    key = (freqs._version, mscale, dtype)  # and the very tensor: a new forward brings a new table
    if _cos_sin_cache.get("freqs") is not freqs or _cos_sin_cache.get("key") != key:
        with torch.no_grad():
            f = freqs.squeeze(1)  # [T, 1, 1, d] -> [T, 1, d], broadcast over heads of t [T, h, d]
            cos, sin = ((fn(f) * mscale).to(dtype) for fn in (torch.cos, torch.sin))
        _cos_sin_cache.update(key=key, freqs=freqs, value=(cos, sin))
    return _cos_sin_cache["value"]


def apply_packed_rope(
    t: torch.Tensor,
    freqs: torch.Tensor,
    config: Any,
    cu_seqlens: torch.Tensor | None = None,
    mscale: float = 1.0,
    cp_group: Any = None,
) -> torch.Tensor:
    """`megatron.core.models.common.embeddings.rope_utils.apply_rotary_pos_emb`, with a fast path for THD rows
    whose table has one row per token (slime's packed rows) on a single CP rank. A scaled RoPE's attention
    factor (YaRN's mscale; `rope_scaling.py`) multiplies cos and sin, as HF's rotary embedding does."""
    mscale = mscale * getattr(config, "slime_rope_attention_factor", 1.0)  # set on slime's scaled-RoPE configs
    if (
        cu_seqlens is not None
        and cp_group is not None
        and cp_group.size() == 1
        and t.dim() == 3
        and freqs.dim() == 4
        and freqs.size(0) == t.size(0)
        and freqs.size(-1) == t.size(-1)
        and not config.apply_rope_fusion
        and not config.rotary_interleaved
        and not config.multi_latent_attention
    ):
        cos, sin = _cos_sin(freqs, mscale, t.dtype)
        return _rotate(t, cos, sin)
    return _megatron_apply_rotary_pos_emb(t, freqs, config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=cp_group)


def use_packed_rope() -> None:
    """Route megatron's attention through `apply_packed_rope` (idempotent; process-wide, as megatron's own
    function is: every model of the process builds its attention from the same module)."""
    global _megatron_apply_rotary_pos_emb
    from megatron.core.transformer import attention

    if attention.apply_rotary_pos_emb is apply_packed_rope:
        return
    _megatron_apply_rotary_pos_emb = attention.apply_rotary_pos_emb
    attention.apply_rotary_pos_emb = apply_packed_rope
