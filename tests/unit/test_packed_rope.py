"""`rope.apply_packed_rope` (megatron's THD RoPE without per-sample host syncs) and `wgrad_fusion` (weight
gradients accumulated into fp32 main grads inside the GEMM): both compute what megatron's own paths compute."""

from __future__ import annotations

import types

import pytest
import torch

pytestmark = pytest.mark.cpu

rope_utils = pytest.importorskip("megatron.core.models.common.embeddings.rope_utils")

from slime.backends.megatron import rope, wgrad_fusion  # noqa: E402

CONFIG = types.SimpleNamespace(apply_rope_fusion=False, rotary_interleaved=False, multi_latent_attention=False)


class _Group:
    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return 0


def _row(lengths: list[int], heads: int = 3, dim: int = 8, dtype: torch.dtype = torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    t = torch.randn(total, heads, dim, generator=g, dtype=torch.float32).to(dtype)
    # per-token positions: each sample counts from an arbitrary start (a branch continues after its prompt)
    pos = torch.cat([torch.arange(n) + int(torch.randint(0, 5, (1,), generator=g)) for n in lengths])
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    freqs = torch.outer(pos.float(), inv)
    freqs = torch.cat([freqs, freqs], dim=-1)[:, None, None, :]  # [T, 1, 1, dim], megatron's layout
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return t, freqs, cu


@pytest.mark.parametrize("lengths", [[16], [5, 9, 2], [1, 1, 1, 7]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_rope_equals_megatrons_thd_rope_forward_and_backward(lengths: list[int], dtype: torch.dtype) -> None:
    rope.use_packed_rope()  # records megatron's function for the fall-through
    t, freqs, cu = _row(lengths, dtype=dtype)
    a, b = t.clone().requires_grad_(), t.clone().requires_grad_()
    ours = rope.apply_packed_rope(a, freqs, CONFIG, cu_seqlens=cu, mscale=1.0, cp_group=_Group(1))
    theirs = rope_utils._apply_rotary_pos_emb_thd(b, cu, freqs, cp_group=_Group(1))
    assert ours.dtype == theirs.dtype == dtype
    assert torch.equal(ours, theirs)  # the same formula, op for op, on CPU
    g = torch.randn_like(ours)
    ours.backward(g)
    theirs.backward(g)
    assert torch.equal(a.grad, b.grad)


def test_cos_sin_are_computed_once_per_table_and_mscale_is_applied() -> None:
    rope.use_packed_rope()
    t, freqs, cu = _row([4, 4])
    first = rope._cos_sin(freqs, 1.0, t.dtype)
    assert rope._cos_sin(freqs, 1.0, t.dtype) is first  # the second layer (and k) reuse them
    scaled = rope.apply_packed_rope(t, freqs, CONFIG, cu_seqlens=cu, mscale=0.5, cp_group=_Group(1))
    want = rope_utils._apply_rotary_pos_emb_thd(t, cu, freqs, mscale=0.5, cp_group=_Group(1))
    assert torch.equal(scaled, want)
    other = freqs.clone()  # a new forward's table: recomputed, not served from the cache
    assert rope._cos_sin(other, 1.0, t.dtype) is not first


def test_other_layouts_fall_through_to_megatron(monkeypatch: pytest.MonkeyPatch) -> None:
    rope.use_packed_rope()
    seen = []
    monkeypatch.setattr(rope, "_megatron_apply_rotary_pos_emb", lambda *a, **k: seen.append(k) or "megatron")
    t, freqs, cu = _row([6, 2])
    short = freqs[:6]  # a max-length table (megatron's "traditional" mapping), not one row per token
    assert rope.apply_packed_rope(t, short, CONFIG, cu_seqlens=cu, cp_group=_Group(1)) == "megatron"
    assert rope.apply_packed_rope(t, freqs, CONFIG, cu_seqlens=cu, cp_group=_Group(2)) == "megatron"
    assert rope.apply_packed_rope(t, freqs, CONFIG, cu_seqlens=None, cp_group=_Group(1)) == "megatron"
    interleaved = types.SimpleNamespace(**{**vars(CONFIG), "rotary_interleaved": True})
    assert rope.apply_packed_rope(t, freqs, interleaved, cu_seqlens=cu, cp_group=_Group(1)) == "megatron"
    assert len(seen) == 4


def test_megatron_attention_uses_the_packed_rope_once_installed() -> None:
    from megatron.core.transformer import attention

    rope.use_packed_rope()
    rope.use_packed_rope()  # idempotent: the fall-through stays megatron's function, not our own
    assert attention.apply_rotary_pos_emb is rope.apply_packed_rope
    assert rope._megatron_apply_rotary_pos_emb is rope_utils.apply_rotary_pos_emb


def test_wgrad_accumulation_adds_the_weight_gradient_into_the_main_grad() -> None:
    g = torch.Generator().manual_seed(1)
    x, dy = torch.randn(10, 4, generator=g), torch.randn(10, 3, generator=g)
    main = torch.randn(3, 4, generator=g)
    want = main + dy.t() @ x
    wgrad_fusion.wgrad_gemm_accum_fp32(x, dy, main)
    torch.testing.assert_close(main, want)
    half = main.bfloat16()
    want16 = half.clone().addmm_(dy.bfloat16().t(), x.bfloat16())
    wgrad_fusion.wgrad_gemm_accum_fp16(x.bfloat16(), dy.bfloat16(), half)
    assert torch.equal(half, want16)


def test_wgrad_fusion_is_off_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert wgrad_fusion.use_wgrad_accumulation_fusion() is False
