"""slime's core attention for megatron-core's local layer spec: SDPA, causal, GQA, packed (THD) sequences.

Why our own: megatron-core 0.16.1's local `DotProductAttention` asserts `packed_seq_params is None`, and the
module that accepts packed sequences (`TEDotProductAttention`) needs TransformerEngine, which is not
installable here. slime trains on packed micro-batches (all samples of a micro-batch in one row), so the
core attention must keep samples apart. It is also the GPU fast path: SDPA dispatches to fused kernels, where
the local spec's unfused baddbmm + softmax materialises every score (in an early H200 measurement of a 1.8B
model, 16.7% MFU unfused against 40.1% with this wrapper; current numbers in docs/performance.md).

Shapes (what `SelfAttention.forward` hands over, megatron/core/transformer/attention.py in 0.16.1):
- unpacked: q [s, b, np, hn], k/v [s, b, ng, hn] → out [s, b, np*hn];
- packed (`packed_seq_params.qkv_format == "thd"`): q [t, np, hn], k/v [t, ng, hn] (batch squeezed away)
  → out [t, np*hn]. Rows packed by slime (packing.py) carry their segments in `_slime_segments`: a sample
  attends causally to itself; a branch of a shared prompt attends to the whole prompt and causally to itself.
  Other `PackedSeqParams` are read the usual way: each `[cu_seqlens_q[i], cu_seqlens_q[i+1])` segment
  attends causally to itself only. RoPE has already been applied to q and k (rope.py).
- context parallel (a row carrying a `CPShard` in `_slime_cp`): q/k/v hold this rank's zigzag chunks of the
  row; keys and values are all-gathered over the CP group and each local query attends under the same rules
  in whole-row coordinates (context_parallel.py), so the result is the single-rank one.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from slime.backends.megatron.context_parallel import gather_over_cp

logger = logging.getLogger(__name__)


class SDPACoreAttention(MegatronModule):
    """Drop-in `core_attention` for `SelfAttentionSubmodules` (same constructor as `DotProductAttention`)."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: object | None = None,
    ) -> None:
        super().__init__(config=config)
        if config.softmax_type != "vanilla" or config.window_size is not None:
            raise NotImplementedError("SDPACoreAttention supports vanilla softmax without sliding windows only")
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        if config.apply_query_key_layer_scaling:
            # Megatron divides the scale by layer_number and multiplies it back inside softmax: net no-op in fp32.
            logger.debug("apply_query_key_layer_scaling has no effect with SDPA (softmax is computed in fp32)")
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def _is_causal(self, attn_mask_type: AttnMaskType | None) -> bool:
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        return "causal" in mask_type.name

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: object) -> torch.Tensor:
        # q [.., np, L, hn], k/v [.., ng, L, hn]; SDPA's GQA repeats each KV head over its np/ng query heads,
        # matching megatron's `repeat_interleave` (query group g serves heads g*np/ng .. (g+1)*np/ng - 1).
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            dropout_p=self.dropout_p if self.training else 0.0,
            scale=self.softmax_scale,
            enable_gqa=q.size(-3) != k.size(-3),
            **kw,
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise NotImplementedError("attention_bias is not supported by SDPACoreAttention")
        causal = self._is_causal(attn_mask_type)
        if self.config.context_parallel_size > 1 and getattr(packed_seq_params, "_slime_cp", None) is None:
            raise NotImplementedError("context parallelism needs slime's packed rows (context_parallel.py)")
        if packed_seq_params is not None:
            if packed_seq_params.qkv_format != "thd":
                raise NotImplementedError(f"packed qkv_format {packed_seq_params.qkv_format!r} (only 'thd')")
            return self._forward_thd(query, key, value, packed_seq_params, causal)

        # [s, b, h, d] -> [b, h, s, d]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        if attention_mask is None:
            out = self._sdpa(q, k, v, is_causal=causal)
        else:
            # megatron's masks are True where attention is *forbidden*; SDPA's boolean masks the opposite.
            allowed = ~attention_mask.bool()
            if causal:
                s_q, s_k = q.size(-2), k.size(-2)
                allowed = allowed & torch.ones(s_q, s_k, dtype=torch.bool, device=q.device).tril()
            out = self._sdpa(q, k, v, attn_mask=allowed)
        # [b, np, s, hn] -> [s, b, np*hn]
        return out.permute(2, 0, 1, 3).reshape(query.size(0), query.size(1), -1)

    def _forward_thd(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        params: PackedSeqParams,
        causal: bool,
    ) -> torch.Tensor:
        if getattr(params, "_slime_positions", None) is not None and not getattr(params, "_slime_rope_applied", False):
            # slime's packed rows put one RoPE segment over the whole row (packing.py); megatron's own rotary
            # embedding would number the row's tokens 0..T-1 and every sample but the first would be wrong.
            raise RuntimeError(
                "slime-packed sequences need the model built by slime's build_gpt_model (positional RoPE)"
            )
        if query.dim() == 4:  # tolerate an unsqueezed batch of one
            query, key, value = (x.squeeze(1) for x in (query, key, value))
        shard = getattr(params, "_slime_cp", None)
        if shard is not None and shard.size > 1:
            # local queries against the whole row's keys and values (context_parallel.py)
            key, value = gather_over_cp(key, shard), gather_over_cp(value, shard)
        out = query.new_zeros(query.size(0), query.size(1), value.size(-1))
        for b in _length_buckets(params, query.device):
            if b.rows_q is None:  # one whole segment of this length: slices are views, no gather
                qs, ks = b.starts
                q = query[qs : qs + b.len_q].transpose(0, 1).unsqueeze(0)  # [1, np, L, hn]
                k = key[ks : ks + b.len_kv].transpose(0, 1).unsqueeze(0)
                v = value[ks : ks + b.len_kv].transpose(0, 1).unsqueeze(0)
            else:
                q = query[b.rows_q].transpose(1, 2)
                k, v = key[b.rows_kv].transpose(1, 2), value[b.rows_kv].transpose(1, 2)
            if b.mask is not None:  # a branch or a CP piece: bottom-right causal, after any shared prompt
                res = self._sdpa(q, k, v, attn_mask=b.mask)
            else:
                res = self._sdpa(q, k, v, is_causal=causal)
            res = res.transpose(1, 2)  # [n, L, np, hn]
            if b.rows_q is None:
                out[b.starts[0] : b.starts[0] + b.len_q] = res.squeeze(0)
            else:
                out[b.rows_q.reshape(-1)] = res.reshape(-1, *res.shape[2:])
        return out.reshape(query.size(0), -1)


@dataclass
class _Bucket:
    """Segments of one shape, attended in one SDPA call: queries `rows_q` [n, len_q], keys/values `rows_kv`."""

    len_q: int
    len_kv: int
    starts: tuple[int, int]  # (q, kv) start of the first segment: the view path when it is alone
    rows_q: torch.Tensor | None  # None: a single segment without a shared prompt, sliced as views
    rows_kv: torch.Tensor | None
    mask: torch.Tensor | None  # [len_q, len_kv] allowed: prompt + causal own tokens, bottom-right aligned


def _segments(params: PackedSeqParams) -> list[tuple[int, int, int, int, int, int]]:
    """(q_start, len_q, kv_start, len_kv, prefix_start, prefix_len) of every non-empty query piece.

    Queries [q_start, q_start + len_q) are the *last* len_q of the keys [kv_start, kv_start + len_kv) (causal,
    bottom-right aligned), after the shared prompt's keys. Without CP a piece is a whole segment (len_q ==
    len_kv, q_start == kv_start); with CP it is the part of a segment that lies in one of this rank's chunks,
    q_start local, keys in whole-row coordinates.
    """
    tree = getattr(params, "_slime_segments", None)
    if tree is not None:  # slime's packing (packing.py): self-attention, maybe over a shared prompt
        shard = getattr(params, "_slime_cp", None)
        if shard is None or shard.size == 1:
            return [(qs, n, qs, n, ps, pl) for qs, n, ps, pl in tree]
        out = []
        for cs, ce, local in shard.local_pieces():
            for qs, n, ps, pl in tree:
                a, b = max(qs, cs), min(qs + n, ce)
                if a < b:
                    out.append((local + a - cs, b - a, qs, b - qs, ps, pl))
        return out
    cu_q = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
    cu_kv = params.cu_seqlens_kv_padded if params.cu_seqlens_kv_padded is not None else params.cu_seqlens_kv
    bounds_q = cu_q.tolist()
    bounds_kv = cu_kv.tolist() if cu_kv is not None else bounds_q
    out = []
    for i in range(len(bounds_q) - 1):
        qs, qe, ks, ke = bounds_q[i], bounds_q[i + 1], bounds_kv[i], bounds_kv[i + 1]
        if qe > qs:
            out.append((qs, qe - qs, ks, ke - ks, 0, 0))
    return out


def _length_buckets(params: PackedSeqParams, device: torch.device) -> list[_Bucket]:
    """Segments grouped by shape (query length, key length, shared-prompt length), one SDPA call per group.

    Segments of equal shape share one batched SDPA call: exact block-diagonal causal attention without a t×t
    mask, and a micro-batch of many short samples (RL rollouts of similar length) costs a few calls instead of
    one per sample; long samples of distinct lengths keep one call each (sliced as views). A branch of a
    shared prompt gathers the prompt's rows before its own as keys, under a bottom-right causal mask. Every
    layer gets the same `params`, so the plan is built once per micro-batch and kept on it: one host sync for
    `cu_seqlens` and one set of index tensors per forward instead of per layer.
    """
    cached = getattr(params, "_slime_length_buckets", None)
    if cached is not None:
        return cached
    groups: dict[tuple[int, int, int], list[tuple[int, int, int]]] = {}
    for qs, len_q, ks, len_kv, ps, pl in _segments(params):
        groups.setdefault((len_q, len_kv, pl), []).append((qs, ks, ps))
    plan: list[_Bucket] = []
    for (len_q, len_kv, pl), starts in groups.items():
        first = (starts[0][0], starts[0][1])
        mask = None
        if pl or len_kv != len_q:  # query i sees the prompt and its own keys up to kv row len_kv - len_q + i
            mask = torch.ones(len_q, pl + len_kv, dtype=torch.bool, device=device).tril(diagonal=pl + len_kv - len_q)
        if len(starts) == 1 and pl == 0:
            plan.append(_Bucket(len_q, len_kv, first, None, None, mask))
            continue
        st = torch.tensor(starts, device=device)
        rows_q = st[:, :1] + torch.arange(len_q, device=device)  # [n, L] token rows
        rows_kv = st[:, 1:2] + torch.arange(len_kv, device=device)
        if pl:
            rows_kv = torch.cat([st[:, 2:] + torch.arange(pl, device=device), rows_kv], dim=1)
        plan.append(_Bucket(len_q, pl + len_kv, first, rows_q, rows_kv, mask))
    params._slime_length_buckets = plan  # megatron's dataclass has no slots: a plain attribute
    return plan
