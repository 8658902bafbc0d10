"""Sequence parallelism through real megatron-core on gloo (TP=2, 2 processes): the same GPTModel with and without
`--sequence-parallel` gives the same logits on a packed row with shared prompts and the same gradient for every
parameter, once the norm weights' gradients (each TP rank saw half the tokens) are summed over TP as megatron's
`finalize_model_grads` does for weights marked `sequence_parallel`.

Qwen3 (Q/K norms next to the sequence-parallel layer norms) with a vocabulary TP must pad. Negative control: without
that sum, the norm gradients differ. The full training step (DDP, finalize, optimizer, metrics) under SP is in
test_megatron_layouts.py and test_moe_layouts.py.
"""

from __future__ import annotations

import os

import pytest
import torch

from sim.rank_spawn import spawn_ranks
from slime.utils.http_utils import find_free_port
from tests.unit.test_megatron_parallel import SHIM, _build_checkpoint, _sequences, _shared_prompt_samples

pytestmark = [pytest.mark.cpu, pytest.mark.slow]

CONFIG = dict(vocab_size=97, num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)


def _worker(rank: int, port: int, ckpt: str, out_dir: str) -> None:
    from slime.arguments import default_args
    from slime.backends.megatron import hf_weights, packing
    from slime.backends.megatron.hf_config import read_hf_config
    from slime.backends.megatron.initialize import destroy_megatron, init_distributed, init_megatron
    from slime.backends.megatron.model_provider import RMSNorm, build_gpt_model

    torch.set_num_threads(1)
    args = default_args(custom_megatron_init_path=SHIM, seed=1234, tensor_model_parallel_size=2)
    init_distributed(args, rank, 2, "127.0.0.1", port)
    ps = init_megatron(args)
    spec = read_hf_config(ckpt)
    shared, plens = _shared_prompt_samples(_sequences(spec.vocab_size))
    packed = packing.pack_samples(shared, pad_multiple=4, prompt_lengths=plens)
    assert packed.pad > 0  # 26 tokens padded to 28: the pad segment runs on the second TP rank
    weights = torch.randn(packed.total_len, spec.vocab_size + 1, generator=torch.Generator().manual_seed(3))
    weights[:, spec.vocab_size :] = 0  # the column TP pads the vocabulary with
    real = packed.total_len - packed.pad
    res: dict = {}
    for sp in (False, True):
        args.sequence_parallel = sp
        model = build_gpt_model(args, spec)
        hf_weights.load_hf_weights(model, ckpt, spec, ps)
        out = model(packed.tokens, packed.position_ids, None, packed_seq_params=packed.packed_seq_params)
        logits = torch.cat(ps.all_gather(out[0].detach(), "tp"), dim=-1)[..., : spec.vocab_size]
        shard = weights.chunk(2, dim=-1)[ps.rank("tp")]  # a linear loss on this rank's vocabulary columns
        (out[0][:real] * shard[:real]).sum().backward()
        marked = {n for n, p in model.named_parameters() if getattr(p, "sequence_parallel", False)}
        raw = {n: p.grad.clone() for n, p in model.named_parameters()}
        summed = {n: ps.all_reduce(g.clone(), "sum", "tp") if n in marked else g for n, g in raw.items()}
        res[sp] = {
            "logits": logits.detach(),
            "marked": marked,
            "norms": {n for n, m in model.named_modules() if isinstance(m, RMSNorm)},
            "raw": dict(hf_weights.iter_hf_tensors(list(raw.items()), spec, ps)),
            "grads": dict(hf_weights.iter_hf_tensors(list(summed.items()), spec, ps)),
            "config_sp": model.config.sequence_parallel,
        }
    if rank == 0:
        torch.save(res, os.path.join(out_dir, "sp.pt"))
    destroy_megatron()


@pytest.fixture(scope="module")
def res(tmp_path_factory):
    root = tmp_path_factory.mktemp("sequence_parallel")
    _build_checkpoint(root / "model", "Qwen3Config", CONFIG)
    spawn_ranks(_worker, args=(find_free_port(), str(root / "model"), str(root)), nprocs=2, daemon=True)
    return torch.load(root / "sp.pt")


def test_sp_is_on_and_marks_exactly_the_sequence_parallel_norms(res):
    assert res[True]["config_sp"] and not res[False]["config_sp"]
    assert not res[False]["marked"]
    norms = res[True]["norms"]
    assert any("q_layernorm" in n for n in norms) and "decoder.final_layernorm" in norms
    # layer and final norms run on this rank's slice of the sequence; the Q/K norms on whole-sequence heads
    want = {f"{n}.weight" for n in norms if not n.endswith(("q_layernorm", "k_layernorm"))}
    assert res[True]["marked"] == want and len(want) == 2 * 2 + 1


def test_sp_logits_equal_non_sp(res):
    a, b = res[False]["logits"], res[True]["logits"]
    assert a.abs().max() > 0.5
    assert (a - b).abs().max() <= 1e-5


def test_sp_gradients_equal_non_sp_after_the_tp_sum(res):
    want, got = res[False]["grads"], res[True]["grads"]
    assert set(want) == set(got)
    scale = max(float(g.abs().max()) for g in want.values())
    for n, g in want.items():
        assert float((got[n] - g).abs().max()) <= 1e-5 * scale, n


def test_negative_control_norm_gradients_without_the_tp_sum_differ(res):
    want, raw = res[False]["grads"], res[True]["raw"]
    name = "model.layers.0.input_layernorm.weight"
    assert float((raw[name] - want[name]).abs().max()) > 1e-3 * float(want[name].abs().max())
