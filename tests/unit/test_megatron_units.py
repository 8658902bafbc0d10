"""In-process checks of the megatron backend's pure pieces: HF config mapping, weight layouts, packing,
the SDPA core attention, and the init hook's error. No process group is created here (see
test_megatron_parallel.py for real GPTModels on gloo)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from slime.utils.errors import SlimeArgError
from tests.hypothesis_budget import examples

pytestmark = pytest.mark.cpu

megatron = pytest.importorskip("megatron.core")

from megatron.core.transformer import TransformerConfig  # noqa: E402
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402

from slime.backends.megatron import hf_config, hf_weights, packing  # noqa: E402
from slime.backends.megatron.attention import SDPACoreAttention  # noqa: E402
from slime.backends.megatron.model_provider import mask_padded_vocab  # noqa: E402

_QWEN2 = dict(
    model_type="qwen2",
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_theta": 500000.0, "rope_type": "default"},
    tie_word_embeddings=True,
)


# ---------------------------------------------------------------- hf_config


def test_qwen2_config_maps_to_megatron_names(make_args: Callable[..., Any]):
    spec = hf_config.read_hf_config(_QWEN2)
    assert spec.qkv_bias and spec.tie_word_embeddings and not spec.qk_layernorm
    assert (spec.num_query_groups, spec.kv_channels, spec.rope_theta) == (2, 16, 500000.0)
    kw = hf_config.transformer_config_kwargs(spec, make_args(tensor_model_parallel_size=2))
    assert kw["num_query_groups"] == 2 and kw["add_qkv_bias"] and not kw["add_bias_linear"]
    assert kw["normalization"] == "RMSNorm" and kw["gated_linear_unit"] and kw["layernorm_epsilon"] == 1e-6
    assert kw["params_dtype"] == torch.float32 and kw["hidden_dropout"] == 0.0
    TransformerConfig(**kw)  # megatron accepts it


def test_llama_and_qwen3_variants():
    llama = hf_config.read_hf_config(
        {**_QWEN2, "model_type": "llama", "attention_bias": False, "head_dim": 32, "rope_theta": 1e4}
    )
    assert not llama.qkv_bias and llama.kv_channels == 32
    qwen3 = hf_config.read_hf_config({**_QWEN2, "model_type": "qwen3"})
    assert qwen3.qk_layernorm and not qwen3.qkv_bias


@pytest.mark.parametrize(
    "patch,needle",
    [
        ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported"),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "rope type 'longrope'"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"use_sliding_window": True}, "sliding-window"),
    ],
)
def test_unsupported_configs_fail_with_one_line(patch, needle):
    with pytest.raises(SlimeArgError, match=needle) as e:
        hf_config.read_hf_config({**_QWEN2, **patch})
    assert "\n" not in str(e.value)


def test_tp_must_fit_heads(make_args: Callable[..., Any]):
    spec = hf_config.read_hf_config(_QWEN2)
    with pytest.raises(SlimeArgError, match="--tensor-model-parallel-size 3"):
        hf_config.transformer_config_kwargs(spec, make_args(tensor_model_parallel_size=3))


def test_missing_checkpoint_dir(tmp_path):
    with pytest.raises(SlimeArgError, match="no config.json"):
        hf_config.read_hf_config(tmp_path)


def test_padded_vocab_and_mask():
    assert hf_config.padded_vocab_size(97, 2) == 98 and hf_config.padded_vocab_size(96, 2) == 96
    logits = torch.zeros(3, 49)
    masked = mask_padded_vocab(logits, 97, tp_rank=1)  # columns 49..97, the last one is padding
    assert masked[:, -1].eq(-1.0e4).all() and masked[:, :-1].eq(0).all()
    assert mask_padded_vocab(logits, 97, tp_rank=0) is logits


# ---------------------------------------------------------------- weight layouts


@settings(max_examples=examples(200), deadline=None)
@given(
    ng=st.integers(1, 4),
    q_per_group=st.integers(1, 3),
    hn=st.integers(1, 4),
    h=st.integers(1, 5),
    bias=st.booleans(),
)
def test_qkv_fusion_layout_and_roundtrip(ng, q_per_group, hn, h, bias):
    heads = ng * q_per_group
    tail = () if bias else (h,)
    q, k, v = (torch.randn(n * hn, *tail) for n in (heads, ng, ng))
    fused = hf_weights.fuse_qkv(q, k, v, ng)
    block = (q_per_group + 2) * hn
    for g in range(ng):  # megatron's per-group interleave: [q heads of g, k_g, v_g]
        rows = fused[g * block : (g + 1) * block]
        assert torch.equal(rows[: q_per_group * hn], q[g * q_per_group * hn : (g + 1) * q_per_group * hn])
        assert torch.equal(rows[q_per_group * hn : q_per_group * hn + hn], k[g * hn : (g + 1) * hn])
        assert torch.equal(rows[-hn:], v[g * hn : (g + 1) * hn])
    back = hf_weights.split_qkv(fused, ng, heads, hn)
    assert all(torch.equal(a, b) for a, b in zip(back, (q, k, v), strict=True))


@settings(max_examples=examples(200), deadline=None)
@given(tp=st.sampled_from([1, 2, 4]), rows_per_rank=st.integers(1, 4), h=st.integers(1, 4))
def test_fc1_shards_roundtrip(tp, rows_per_rank, h):
    gate, up = torch.randn(tp * rows_per_rank, h), torch.randn(tp * rows_per_rank, h)
    shards = [hf_weights.shard_fc1(gate, up, tp, r) for r in range(tp)]
    for r, s in enumerate(shards):  # each rank's GLU halves are its own gate / up rows
        g, u = s.chunk(2, dim=0)
        assert torch.equal(g, gate.chunk(tp)[r]) and torch.equal(u, up.chunk(tp)[r])
    g2, u2 = hf_weights.unshard_fc1(shards)
    assert torch.equal(g2, gate) and torch.equal(u2, up)


# ---------------------------------------------------------------- packing


def test_pack_samples_layout():
    p = packing.pack_samples([[5, 6, 7], [8], [9, 10]], pad_multiple=4, pad_token_id=0)
    assert p.tokens.tolist() == [[5, 6, 7, 8, 9, 10, 0, 0]]
    assert p.position_ids.tolist() == [[0, 1, 2, 0, 0, 1, 0, 1]]
    assert p.cu_seqlens.tolist() == [0, 3, 4, 6, 8] and p.cu_seqlens.dtype == torch.int32
    assert p.packed_seq_params.qkv_format == "thd" and p.packed_seq_params.max_seqlen_q == 3
    # megatron's RoPE sees one segment with a per-token angle table (rope.py); attention reads the segments
    assert p.packed_seq_params.cu_seqlens_q.tolist() == [0, 8]
    assert p.packed_seq_params._slime_positions.tolist() == p.position_ids[0].tolist()
    assert p.packed_seq_params._slime_segments == [(0, 3, 0, 0), (3, 1, 0, 0), (4, 2, 0, 0), (6, 2, 0, 0)]
    assert not p.shared and p.sample_rows(2) == [4, 5]
    parts = packing.unpack_logits(torch.arange(8 * 3).reshape(1, 8, 3), p, vocab_size=2)
    assert [t.shape for t in parts] == [(3, 2), (1, 2), (2, 2)]
    assert parts[1].tolist() == [[9, 10]]


def test_pack_without_padding_has_no_pad_segment():
    p = packing.pack_samples([torch.tensor([1, 2]), torch.tensor([3, 4])], pad_multiple=2)
    assert p.pad == 0 and p.cu_seqlens.tolist() == [0, 2, 4]
    with pytest.raises(ValueError):
        packing.unpack(torch.zeros(5), p)


# ---------------------------------------------------------------- core attention


def _attention(heads: int, groups: int, hn: int = 8) -> SDPACoreAttention:
    cfg = TransformerConfig(
        num_layers=1,
        hidden_size=heads * hn,
        num_attention_heads=heads,
        num_query_groups=groups,
        attention_dropout=0.0,
        use_cpu_initialization=True,
    )
    return SDPACoreAttention(cfg, 1, AttnMaskType.causal, "self")


def _rope_done(p: packing.PackedBatch):
    # the attention alone: q and k stand for tensors RoPE already rotated (rope.py marks that in a model)
    p.packed_seq_params._slime_rope_applied = True
    return p.packed_seq_params


def _naive(q, k, v, causal_len=None):
    # q [s, np, hn], k/v [s, ng, hn]: the textbook computation with repeated KV heads.
    rep = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / q.size(-1) ** 0.5
    s = q.size(0)
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(s, -1)


@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 2), (4, 1)])
def test_sdpa_matches_naive_gqa(heads, groups):
    attn = _attention(heads, groups)
    torch.manual_seed(0)
    s = 9
    q, k, v = torch.randn(s, 1, heads, 8), torch.randn(s, 1, groups, 8), torch.randn(s, 1, groups, 8)
    out = attn(q, k, v, None)
    assert out.shape == (s, 1, heads * 8)
    torch.testing.assert_close(out[:, 0], _naive(q[:, 0], k[:, 0], v[:, 0]), atol=1e-5, rtol=1e-5)
    # an explicit all-False megatron mask (nothing forbidden) + causal gives the same
    torch.testing.assert_close(attn(q, k, v, torch.zeros(1, 1, s, s, dtype=torch.bool)), out, atol=1e-6, rtol=0)


def test_packed_attention_equals_per_sample():
    attn = _attention(4, 2)
    torch.manual_seed(1)
    lengths = [5, 1, 7, 3]
    p = packing.pack_samples([[0] * n for n in lengths], pad_multiple=8)
    t = p.total_len
    q, k, v = torch.randn(t, 4, 8), torch.randn(t, 2, 8), torch.randn(t, 2, 8)
    out = attn(q, k, v, None, packed_seq_params=_rope_done(p))
    assert out.shape == (t, 32)
    start = 0
    for n in lengths:
        sl = slice(start, start + n)
        single = attn(q[sl, None], k[sl, None], v[sl, None], None)[:, 0]
        torch.testing.assert_close(out[sl], single, atol=1e-6, rtol=0)
        start += n


def test_packed_attention_batches_equal_lengths_exactly():
    # Repeated lengths share one batched SDPA call; values and gradients must still be the per-segment ones.
    attn = _attention(4, 2)
    torch.manual_seed(2)
    lengths = [5, 3, 5, 1, 3, 5, 7, 1]
    p = packing.pack_samples([[0] * n for n in lengths], pad_multiple=16)
    t = p.total_len
    leaves = [torch.randn(t, h, 8, requires_grad=True) for h in (4, 2, 2)]
    w = torch.randn(t, 32)
    w[sum(lengths) :] = 0  # the padding segment (attends to itself) carries no loss
    out = attn(*leaves, None, packed_seq_params=_rope_done(p))
    plan = p.packed_seq_params._slime_length_buckets  # built once per micro-batch, reused by every layer
    assert sorted((b.len_q, b.rows_q is None) for b in plan) == [
        (1, False),
        (2, True),
        (3, False),
        (5, False),
        (7, True),
    ]  # 2: padding
    attn(*leaves, None, packed_seq_params=p.packed_seq_params)
    assert p.packed_seq_params._slime_length_buckets is plan
    (out * w).sum().backward()
    got = [x.grad.clone() for x in leaves]
    for x in leaves:
        x.grad = None
    ref, start = [], 0
    for n in lengths:
        sl = slice(start, start + n)
        ref.append(_naive(*(x[sl] for x in leaves)))
        start += n
    ref = torch.cat(ref)
    torch.testing.assert_close(out[:start], ref, atol=1e-5, rtol=1e-5)
    (ref * w[:start]).sum().backward()
    for g, x in zip(got, leaves, strict=True):
        torch.testing.assert_close(g, x.grad, atol=1e-5, rtol=1e-5)


def _shared_batch(data) -> tuple[list[list[int]], list[int]]:
    """Samples drawn as (prompt id, branch) pairs: siblings share their prompt's tokens exactly."""
    prompts = data.draw(st.lists(st.integers(0, 6), min_size=1, max_size=4))  # prompt lengths (0: no prompt)
    picks = data.draw(st.lists(st.tuples(st.integers(0, len(prompts) - 1), st.integers(0, 5)), min_size=1, max_size=9))
    samples, plens = [], []
    for k, (which, r) in enumerate(picks):
        prompt = [100 + 10 * which + j for j in range(prompts[which])]
        samples.append(prompt + [k * 7 + j + 1 for j in range(r)])
        plens.append(len(prompt))
    return samples, plens


@settings(max_examples=examples(200), deadline=None)
@given(data=st.data(), pad_multiple=st.sampled_from([1, 4, 8]))
def test_shared_prompt_packing_round_trips(data, pad_multiple):
    samples, plens = _shared_batch(data)
    if sum(map(len, samples)) == 0:
        samples[0].append(1)
    p = packing.pack_samples(samples, pad_multiple=pad_multiple, prompt_lengths=plens)
    assert p.total_len % pad_multiple == 0
    # every sample reads back exactly its own tokens at its own positions 0..L-1
    assert [t.tolist() for t in packing.unpack(p.tokens, p)] == samples
    assert [t.tolist() for t in packing.unpack(p.position_ids, p)] == [list(range(len(x))) for x in samples]
    rows = [t.tolist() for t in packing.unpack(torch.arange(p.total_len), p)]
    assert [p.sample_rows(i) for i in range(len(samples))] == rows
    last = data.draw(st.integers(0, 12))  # the tail a response reader asks for, up to past the sample's start
    assert [p.sample_rows(i, last=last) for i in range(len(samples))] == [
        r[len(r) - min(last, len(r)) :] for r in rows
    ]
    # each distinct non-empty prompt shared by >= 2 samples is packed once; nothing else is saved
    by_prompt: dict[tuple, int] = {}
    for x, n in zip(samples, plens, strict=True):
        if n:
            by_prompt[tuple(x[:n])] = by_prompt.get(tuple(x[:n]), 0) + 1
    saved = sum((c - 1) * len(k) for k, c in by_prompt.items() if c > 1)
    assert p.total_len - p.pad == sum(map(len, samples)) - saved
    # segments tile the row in order; a branch's prompt lies before it and has the prompt's length
    segs = p.packed_seq_params._slime_segments
    assert [q for q, _, _, _ in segs] == p.cu_seqlens.tolist()[:-1]
    assert sum(n for _, n, _, _ in segs) == p.total_len
    for q, _, ps, pl in segs:
        assert pl == 0 or (ps + pl <= q and pl in plens)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_shared_prompt_attention_equals_per_sample(data):
    """Values and gradients of the tree-packed attention equal textbook attention on each sample alone."""
    samples, plens = _shared_batch(data)
    if sum(map(len, samples)) == 0:
        samples[0].append(1)
    attn = _attention(4, 2)
    p = packing.pack_samples(samples, pad_multiple=4, prompt_lengths=plens)
    t = p.total_len
    g = torch.Generator().manual_seed(len(samples) * 31 + t)
    leaves = [torch.randn(t, h, 8, generator=g).requires_grad_() for h in (4, 2, 2)]
    out = attn(*leaves, None, packed_seq_params=_rope_done(p))
    per = packing.unpack(out, p)
    weights = [torch.randn(len(x), 32, generator=g) for x in samples]
    sum((o * w).sum() for o, w in zip(per, weights, strict=True)).backward()
    got = [x.grad.clone() for x in leaves]
    for x in leaves:
        x.grad = None
    ref = [_naive(*(packing.unpack(x, p)[i] for x in leaves)) if samples[i] else None for i in range(len(samples))]
    for i, r in enumerate(ref):
        if r is not None:
            torch.testing.assert_close(per[i], r, atol=1e-5, rtol=1e-5)
    sum((r * w).sum() for r, w in zip(ref, weights, strict=True) if r is not None).backward()
    for gt, x in zip(got, leaves, strict=True):
        torch.testing.assert_close(gt, x.grad, atol=1e-5, rtol=1e-5)


def test_shared_prompt_bad_input_and_unrotated_rows():
    with pytest.raises(ValueError, match="prompt length 4 outside"):
        packing.pack_samples([[1, 2, 3]], prompt_lengths=[4])
    with pytest.raises(ValueError, match="2 prompt lengths for 1 samples"):
        packing.pack_samples([[1, 2, 3]], prompt_lengths=[1, 1])
    p = packing.pack_samples([[1, 2, 3], [1, 2, 4]], prompt_lengths=[2, 2])
    assert p.shared and p.total_len == 4 and p.position_ids.tolist() == [[0, 1, 2, 2]]
    x = torch.randn(4, 4, 8)
    with pytest.raises(RuntimeError, match="positional RoPE"):  # a model whose RoPE ignored the positions
        _attention(4, 4)(x, x, x, None, packed_seq_params=p.packed_seq_params)


# ---------------------------------------------------------------- initialize


_HOOK_CALLS: list[object] = []


def _record_hook(args: object) -> None:
    _HOOK_CALLS.append(args)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error path")
def test_cpu_without_hook_names_the_flag(make_args: Callable[..., Any]):
    from slime.backends.megatron.initialize import cpu_shim_hooks, init_distributed, run_custom_megatron_init

    assert cpu_shim_hooks() == ["sim.fake_megatron.cpu_shim.apply"]  # the simulator's, registered in pyproject.toml

    args = make_args(custom_megatron_init_path=None)
    for call in (lambda: run_custom_megatron_init(args), lambda: init_distributed(args, 0, 1, "127.0.0.1", 1)):
        with pytest.raises(SlimeArgError, match="--custom-megatron-init-path") as e:
            call()
        assert "sim.fake_megatron.cpu_shim.apply" in str(e.value) and "\n" not in str(e.value)


def test_custom_init_hook_is_called_with_args(make_args: Callable[..., Any]):
    from slime.backends.megatron.initialize import run_custom_megatron_init

    args = make_args(custom_megatron_init_path=f"{__name__}._record_hook")
    run_custom_megatron_init(args)
    assert _HOOK_CALLS[-1] is args


def test_cpu_shim_clip_scales_only_above_max_norm():
    from sim.fake_megatron.cpu_shim import _clip_grad_by_total_norm, _is_cuda

    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.tensor([3.0, 4.0, 0.0])
    _clip_grad_by_total_norm([p], max_norm=10.0, total_norm=5.0)
    assert p.grad.tolist() == [3.0, 4.0, 0.0]
    _clip_grad_by_total_norm([p], max_norm=1.0, total_norm=5.0)
    torch.testing.assert_close(p.grad, torch.tensor([0.6, 0.8, 0.0]), atol=1e-6, rtol=0)
    assert _is_cuda("cuda:1") and _is_cuda(torch.device("cuda")) and _is_cuda(0)
    assert not (_is_cuda("cpu") or _is_cuda(None) or _is_cuda(True))


@pytest.mark.parametrize("env, expected", [("3", 3), ("", 1)])
def test_cpu_shim_threads_opt_in(env, expected):
    """SLIME_CPU_THREADS lifts Ray's OMP_NUM_THREADS=1 for the CPU trainer; unset, the actor's setting stays."""
    import os
    import subprocess
    import sys

    code = "import torch; import sim.fake_megatron.cpu_shim as s; s.apply(); print(torch.get_num_threads())"
    env_vars = {**os.environ, "OMP_NUM_THREADS": "1", "SLIME_CPU_THREADS": env, "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, "-c", code], env=env_vars, capture_output=True, text=True, check=True)
    assert int(out.stdout.strip().splitlines()[-1]) == expected


@given(multiplier=st.integers(1, 256), cp=st.sampled_from([1, 2, 4, 8]), sp=st.sampled_from([1, 2, 4, 8]))
def test_row_pad_multiple_is_the_least_that_serves_every_split(multiplier, cp, sp):
    m = packing.row_pad_multiple(multiplier, cp, sp)
    need = [multiplier, sp] + ([2 * cp * sp] if cp > 1 else [])
    assert all(m % k == 0 for k in need)
    assert not any(all(d % k == 0 for k in need) for d in range(1, m))  # nothing smaller would do
