"""Real megatron-core GPTModels on CPU over gloo (2 processes): same numbers as the HF model, exact packing,
bit-exact HF↔mcore round trips, and TP=2 / DP=2 losses equal to TP=1.

One spawn of 2 ranks (`sim/rank_spawn.py`) does all the work:
phase 1 runs tp=1 (so dp=2), phase 2 re-initialises megatron with tp=2. Each rank writes its measurements
to a file; the tests below assert on them.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from sim.rank_spawn import spawn_ranks
from slime.utils.http_utils import find_free_port

pytestmark = [pytest.mark.cpu, pytest.mark.slow]

SHIM = "sim.fake_megatron.cpu_shim.apply"
# name -> (transformers config class, kwargs). Together they cover: GQA (2 and 1 KV heads, the latter below
# the TP size), MHA, Qwen2 QKV bias, Llama without bias, tied and untied embeddings, Qwen3 q/k norms, and a
# vocabulary that TP=2 must pad (97).
VARIANTS = {
    "qwen2_gqa_tied": (
        "Qwen2Config",
        dict(vocab_size=96, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    ),
    "llama_mha_untied": (
        "LlamaConfig",
        dict(vocab_size=96, num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False),
    ),
    "llama_kv1_untied_v97": (
        "LlamaConfig",
        dict(vocab_size=97, num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=False),
    ),
    "qwen3_gqa_tied": (
        "Qwen3Config",
        dict(vocab_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True),
    ),
}
LOSS_VARIANT = "qwen2_gqa_tied"
LENGTHS = [7, 3, 12, 5]


def _build_checkpoint(out: Path, cls_name: str, kw: dict) -> None:
    import transformers

    cfg = getattr(transformers, cls_name)(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=256, **kw
    )
    torch.manual_seed(0)
    model = getattr(transformers, cls_name.replace("Config", "ForCausalLM"))(cfg).float()
    # HF's init (std 0.02) gives near-constant logits; larger random weights make the comparisons meaningful.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.1)
    model.save_pretrained(out)


def _sequences(vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (n,), generator=g) for n in LENGTHS]


def _shared_prompt_samples(seqs: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[int]]:
    a, b = seqs[2][:6], seqs[0][:4]
    samples = [
        (a, seqs[0][:3]),
        (b, seqs[3][:2]),
        (a, seqs[1]),
        (torch.tensor([], dtype=torch.long), seqs[3]),
        (a, seqs[1][:0]),
        (b, seqs[2][6:9]),
    ]
    return [torch.cat([p, r]) for p, r in samples], [len(p) for p, _ in samples]


def _loss_sums(logits: list[torch.Tensor], seqs: list[torch.Tensor]) -> tuple[float, int]:
    total = sum(
        torch.nn.functional.cross_entropy(lg[:-1], s[1:], reduction="sum") for lg, s in zip(logits, seqs, strict=True)
    )
    return float(total), sum(len(s) - 1 for s in seqs)


def _worker(rank: int, world: int, port: int, ckpts: dict[str, str], out_dir: str) -> None:
    from transformers import AutoModelForCausalLM

    from slime.arguments import default_args
    from slime.backends.megatron import hf_weights, packing
    from slime.backends.megatron.hf_config import read_hf_config
    from slime.backends.megatron.initialize import init_distributed, init_megatron
    from slime.backends.megatron.model_provider import build_gpt_model, mask_padded_vocab
    from slime.backends.megatron.weight_buckets import buckets_by_dtype

    torch.set_num_threads(1)
    args = default_args(custom_megatron_init_path=SHIM, seed=1234, tensor_model_parallel_size=1)
    init_distributed(args, rank, world, "127.0.0.1", port)
    res: dict = {"phase1": {}, "phase2": {}}

    def run_phase(key: str, ps) -> None:
        from megatron.core import tensor_parallel

        tp, tp_rank = ps.size("tp"), ps.rank("tp")
        for name, path in ckpts.items():
            spec = read_hf_config(path)
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            model = build_gpt_model(args, spec).eval()
            hf_weights.load_hf_weights(model, path, spec, ps)
            seqs = _sequences(spec.vocab_size)

            def full_logits(shard: torch.Tensor, vocab: int = spec.vocab_size) -> torch.Tensor:
                return torch.cat(ps.all_gather(shard, "tp"), dim=-1)[..., :vocab]

            with torch.no_grad():
                ref = [hf(s[None]).logits[0] for s in seqs]
                single = [full_logits(model(s[None], torch.arange(len(s))[None], None)[0]) for s in seqs]
                packed = packing.pack_samples(seqs, pad_multiple=8)
                out = model(packed.tokens, packed.position_ids, None, packed_seq_params=packed.packed_seq_params)
                per = packing.unpack_logits(full_logits(out), packed)
                # prompt sharing: siblings of one prompt (one with an empty response) next to a lone sample
                shared, plens = _shared_prompt_samples(seqs)
                sp = packing.pack_samples(shared, pad_multiple=8, prompt_lengths=plens)
                out_sp = model(sp.tokens, sp.position_ids, None, packed_seq_params=sp.packed_seq_params)
                shared_single = [full_logits(model(s[None], torch.arange(len(s))[None], None)[0]) for s in shared]
                r = {
                    "hf_vs_mcore": max((a - b).abs().max().item() for a, b in zip(ref, single, strict=True)),
                    "packed_vs_single": max((a - b).abs().max().item() for a, b in zip(per, single, strict=True)),
                    "shared_vs_single": max(
                        (a - b).abs().max().item()
                        for a, b in zip(packing.unpack_logits(full_logits(out_sp), sp), shared_single, strict=True)
                    ),
                    "shared_rows": (sp.total_len - sp.pad, sum(len(s) for s in shared)),
                    "logit_scale": max(a.abs().max().item() for a in ref),
                }
                if name == LOSS_VARIANT:
                    r["ref_loss"] = _loss_sums(ref, seqs)
                    if tp > 1:  # vocab-parallel cross entropy on the sharded logits, as training does
                        shard = mask_padded_vocab(out[0], spec.vocab_size, tp_rank)
                        # next-token targets; each sample's last position and the pad segment are dropped
                        zero = torch.zeros(1, dtype=torch.long)
                        targets = torch.cat([torch.cat([s[1:], zero]) for s in seqs] + [zero.repeat(packed.pad)])
                        keep = torch.cat([torch.arange(n) < n - 1 for n in LENGTHS] + [zero.repeat(packed.pad) > 0])
                        ce = tensor_parallel.vocab_parallel_cross_entropy(shard[:, None], targets[:, None])[:, 0]
                        r["tp_loss"] = (float(ce[keep].sum()), int(keep.sum()))
                    else:  # dp=2: each rank packs its half of the batch; sums are all-reduced over dp
                        mine = seqs[ps.rank("dp") :: ps.size("dp")]
                        mp = packing.pack_samples(mine, pad_multiple=4)
                        lg = packing.unpack_logits(
                            model(mp.tokens, mp.position_ids, None, packed_seq_params=mp.packed_seq_params), mp
                        )
                        total, count = _loss_sums(lg, mine)
                        buf = torch.tensor([total, float(count)], dtype=torch.float64)
                        ps.all_reduce(buf, "sum", "dp")
                        r["dp_loss"] = (float(buf[0]), int(buf[1]))
            exported = list(buckets_by_dtype(hf_weights.export_hf_weights(model, spec, ps), 16 * 1024))
            r["bucket_sizes"] = [sum(t.numel() * t.element_size() for _, t in b) for b in exported]
            r["bucket_counts"] = [len(b) for b in exported]
            if rank == 0:
                torch.save(dict(kv for b in exported for kv in b), os.path.join(out_dir, f"{key}_{name}.pt"))
            res[key][name] = r

    ps = init_megatron(args)
    res["ps1"] = _collectives(ps)
    run_phase("phase1", ps)

    from megatron.core import parallel_state as mpu

    mpu.destroy_model_parallel()
    args.tensor_model_parallel_size = 2
    ps = init_megatron(args)
    res["ps2"] = {"tp": (ps.rank("tp"), ps.size("tp")), "dp": (ps.rank("dp"), ps.size("dp"))}
    run_phase("phase2", ps)
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))

    from slime.backends.megatron.initialize import destroy_megatron

    destroy_megatron()


def _collectives(ps) -> dict:
    r = ps.rank("dp")
    out = {"dp": (r, ps.size("dp")), "tp": (ps.rank("tp"), ps.size("tp"))}
    out["sum"] = ps.all_reduce(torch.tensor([r + 1.0]), "sum", "dp").item()
    out["avg"] = ps.all_reduce(torch.tensor([r + 1.0]), "avg", "dp").item()
    out["max"] = ps.all_reduce(torch.tensor([r + 1.0]), "max", "dp").item()
    out["gather"] = [t.item() for t in ps.all_gather(torch.tensor([10.0 * r]), "dp")]
    out["bcast"] = ps.broadcast(torch.tensor([r + 5.0]), src=1, dim="dp").item()
    out["rs"] = ps.reduce_scatter(torch.arange(4.0) * (r + 1), "sum", "dp").tolist()
    x = torch.tensor([r + 1.0], requires_grad=True)
    (ps.all_reduce(x, "sum", "dp") * (r + 1)).sum().backward()
    out["grad"] = x.grad.item()  # d/dx_r of sum_k (k+1) * (x_0 + x_1) = 1 + 2
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron_parallel")
    ckpts = {}
    for name, (cls_name, kw) in VARIANTS.items():
        _build_checkpoint(root / name, cls_name, kw)
        ckpts[name] = str(root / name)
    # daemon: should the test be interrupted, the ranks die with it (a failing rank makes spawn stop the other)
    spawn_ranks(_worker, args=(2, find_free_port(), ckpts, str(root)), nprocs=2, daemon=True)
    from safetensors.torch import load_file

    return {
        "ranks": [torch.load(root / f"rank{r}.pt") for r in range(2)],
        "exports": {f.stem: torch.load(f) for f in root.glob("phase*.pt")},
        "hf": {name: load_file(os.path.join(path, "model.safetensors")) for name, path in ckpts.items()},
    }


@pytest.mark.parametrize("phase", ["phase1", "phase2"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gptmodel_matches_hf_and_packing_is_exact(results, phase, variant):
    for rank in results["ranks"]:
        r = rank[phase][variant]
        assert r["logit_scale"] > 0.5  # the comparison is not between near-zero logits
        assert r["hf_vs_mcore"] <= 1e-4, r
        assert r["packed_vs_single"] <= 1e-5, r
        assert r["shared_vs_single"] <= 1e-5, r
        assert r["shared_rows"] == (6 + 4 + 3 + 2 + 3 + 5 + 0 + 3, 6 * 3 + 4 * 2 + 3 + 2 + 3 + 5 + 3), r


@pytest.mark.parametrize("phase", ["phase1", "phase2"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_hf_mcore_hf_roundtrip_is_bit_exact(results, phase, variant):
    hf, got = results["hf"][variant], results["exports"][f"{phase}_{variant}"]
    tied = VARIANTS[variant][1]["tie_word_embeddings"]
    assert set(got) == (set(hf) - {"lm_head.weight"} if tied else set(hf))
    for name, tensor in got.items():
        assert torch.equal(tensor, hf[name]), name
    for rank in results["ranks"]:
        r = rank[phase][variant]
        assert len(r["bucket_counts"]) > 1  # 16 KiB buckets split this model
        assert all(s <= 16 * 1024 or c == 1 for s, c in zip(r["bucket_sizes"], r["bucket_counts"], strict=True))


def test_tp2_and_dp2_losses_equal_tp1(results):
    for rank in results["ranks"]:
        ref_total, ref_count = rank["phase1"][LOSS_VARIANT]["ref_loss"]
        ref = ref_total / ref_count
        dp_total, dp_count = rank["phase1"][LOSS_VARIANT]["dp_loss"]
        tp_total, tp_count = rank["phase2"][LOSS_VARIANT]["tp_loss"]
        assert dp_count == tp_count == ref_count == sum(n - 1 for n in LENGTHS)
        assert abs(dp_total / dp_count - ref) <= 1e-5
        assert abs(tp_total / tp_count - ref) <= 1e-5


def test_parallel_state_layouts_and_collectives(results):
    for r, rank in enumerate(results["ranks"]):
        ps1 = rank["ps1"]
        assert ps1["dp"] == (r, 2) and ps1["tp"] == (0, 1)
        assert rank["ps2"] == {"tp": (r, 2), "dp": (0, 1)}
        assert (ps1["sum"], ps1["avg"], ps1["max"]) == (3.0, 1.5, 2.0)
        assert ps1["gather"] == [0.0, 10.0] and ps1["bcast"] == 6.0
        assert ps1["rs"] == [x * 3.0 for x in range(4)][2 * r : 2 * r + 2]
        assert ps1["grad"] == 3.0
