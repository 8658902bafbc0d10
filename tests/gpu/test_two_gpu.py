"""Two GPUs of one host: TP=2 / DP=2 numerics against one GPU, disaggregated NCCL weight sync, colocated PPO with
DP=2, and a `--sglang-config` topology of two engines behind one router — all through the real code paths.

Each test needs two CUDA GPUs and deselects (skips) cleanly elsewhere. The slime runs go through the same
`slime train` CLI as a user's job, with the fake `hf` engine on CUDA standing in for SGLang (SGLang itself is not
installed on the lent GPU host); each engine sits on its own GPU by `--base-gpu-id`, as SGLang's would.

Tolerances of the numerics test (why these numbers): in fp32 with TF32 off the only differences between layouts
are summation orders (TP's all-reduce of partial row sums, DP's all-reduce of gradients), so loss and gradients
agree to ~1e-6 relative; we allow 1e-4. In bf16 every matmul output and activation is rounded to 8 mantissa bits
(unit roundoff 2^-9 ≈ 2e-3) and a different summation order changes which values round which way; over a few
layers the per-tensor error grows to ~1e-2 of the tensor's norm. We compare each gradient by its relative
Frobenius error (elementwise checks are meaningless at bf16 for near-zero entries) and allow 3e-2; the negative
control (one segment boundary moved by a token) must land far outside that band, so the band can fail.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from slime.utils.http_utils import find_free_port

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (the nvidia-h200-x2 host)"),
]

LENGTHS = [37, 5, 120, 64, 9, 300, 17, 80]
FP32_TOL, BF16_TOL = 1e-4, 3e-2


# ---------------------------------------------------------------- numerics: TP=2 and DP=2 vs one GPU


def _checkpoint(out: Path) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
        vocab_size=512, max_position_embeddings=1024, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).float()
    with torch.no_grad():  # larger than HF's init so logits (and gradients) are far from uniform
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p)) if "norm" in name else p.normal_(0.0, 0.05)
    model.save_pretrained(out)
    return str(out)


def _batch(vocab: int) -> tuple[list[torch.Tensor], list[float]]:
    g = torch.Generator().manual_seed(7)
    seqs = [torch.randint(0, vocab, (n,), generator=g) for n in LENGTHS]
    weights = [1.0, -0.5, 0.25, -1.0, 2.0, 0.5, -0.25, 1.5]  # advantage-like, both signs
    return seqs, weights


def _loss_and_grads(args, spec, ckpt, ps, seqs, weights, dtype, total_tokens, dp_reduce) -> dict:
    """Sum over samples of weight × token NLL / total_tokens (an RL loss's shape), its backward, and every
    gradient gathered to its full HF-named tensor (the export path reads `.data`: we point it at the grads)."""
    from megatron.core import tensor_parallel

    from slime.backends.megatron import hf_weights, packing
    from slime.backends.megatron.model_provider import build_gpt_model, mask_padded_vocab

    model = build_gpt_model(args, spec).cuda()
    hf_weights.load_hf_weights(model, ckpt, spec, ps)
    model = model.to(dtype)
    packed = packing.pack_samples(seqs, pad_multiple=8, device="cuda")
    logits = model(packed.tokens, packed.position_ids, None, packed_seq_params=packed.packed_seq_params)[0]
    logits = mask_padded_vocab(logits.float(), spec.vocab_size, ps.rank("tp"))
    zero = torch.zeros(1, dtype=torch.long)
    targets = torch.cat([torch.cat([s[1:], zero]) for s in seqs] + [zero.repeat(packed.pad)]).cuda()
    w = torch.cat([torch.full((len(s),), wt) for s, wt in zip(seqs, weights, strict=True)] + [torch.zeros(packed.pad)])
    keep = torch.cat([torch.arange(len(s)) < len(s) - 1 for s in seqs] + [torch.zeros(packed.pad, dtype=torch.bool)])
    nll = tensor_parallel.vocab_parallel_cross_entropy(logits[:, None], targets[:, None])[:, 0]
    loss = (nll * (w * keep).cuda()).sum() / total_tokens
    loss.backward()
    loss_sum = loss.detach().double()
    params = list(model.parameters())
    if dp_reduce:
        ps.all_reduce(loss_sum, "sum", "dp")
        for p in params:
            ps.all_reduce(p.grad, "sum", "dp")
    saved = [p.data for p in params]
    for p in params:
        p.data = p.grad
    grads = {n: t.float().cpu() for n, t in hf_weights.export_hf_weights(model, spec, ps)}
    for p, d in zip(params, saved, strict=True):
        p.data = d
    return {"loss": float(loss_sum), "grads": grads}


def _numerics_worker(rank: int, world: int, port: int, ckpt: str, out_dir: str) -> None:
    from megatron.core import parallel_state as mpu

    from slime.arguments import default_args
    from slime.backends.megatron.hf_config import read_hf_config
    from slime.backends.megatron.initialize import destroy_megatron, init_distributed, init_megatron

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    args = default_args(seed=1234, tensor_model_parallel_size=1)
    init_distributed(args, rank, world, "127.0.0.1", port)
    spec = read_hf_config(ckpt)
    seqs, weights = _batch(spec.vocab_size)
    total = sum(len(s) - 1 for s in seqs)
    res: dict = {}
    ps = init_megatron(args)  # tp=1, dp=2
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        res[f"single_{name}"] = _loss_and_grads(args, spec, ckpt, ps, seqs, weights, dtype, total, False)
        mine = slice(ps.rank("dp"), None, ps.size("dp"))
        res[f"dp2_{name}"] = _loss_and_grads(args, spec, ckpt, ps, seqs[mine], weights[mine], dtype, total, True)
    # negative control: sample 0's last token becomes sample 1's first (one boundary moved, same tokens)
    shifted = [seqs[0][:-1], torch.cat([seqs[0][-1:], seqs[1]]), *seqs[2:]]
    res["shifted_fp32"] = _loss_and_grads(args, spec, ckpt, ps, shifted, weights, torch.float32, total, False)
    mpu.destroy_model_parallel()
    args.tensor_model_parallel_size = 2
    ps = init_megatron(args)  # tp=2
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        res[f"tp2_{name}"] = _loss_and_grads(args, spec, ckpt, ps, seqs, weights, dtype, total, False)
    if rank == 0:
        torch.save(res, os.path.join(out_dir, "numerics.pt"))
    destroy_megatron()


@pytest.fixture(scope="module")
def numerics(tmp_path_factory) -> dict:
    import torch.multiprocessing as mp

    root = tmp_path_factory.mktemp("two_gpu_numerics")
    ckpt = _checkpoint(root / "model")
    mp.spawn(_numerics_worker, args=(2, find_free_port(), ckpt, str(root)), nprocs=2, daemon=True)
    res = torch.load(root / "numerics.pt")
    if report := os.environ.get("SLIME_GPU_REPORT_DIR"):  # the numbers docs/performance.md records
        summary = {
            k: {"loss": v["loss"], "loss_rel_err": abs(v["loss"] / res[f"single_{k.split('_')[1]}"]["loss"] - 1),
                "max_grad_rel_err": _max_grad_error(v["grads"], res[f"single_{k.split('_')[1]}"]["grads"])[0]}
            for k, v in res.items()
        }  # fmt: skip
        Path(report).mkdir(parents=True, exist_ok=True)
        (Path(report) / "two_gpu_numerics.json").write_text(json.dumps(summary, indent=1))
    return res


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _max_grad_error(got: dict, ref: dict) -> tuple[float, str]:
    assert set(got) == set(ref)
    return max((_rel(got[n], ref[n]), n) for n in ref)


@pytest.mark.parametrize("layout", ["tp2", "dp2"])
@pytest.mark.parametrize(("precision", "tol"), [("fp32", FP32_TOL), ("bf16", BF16_TOL)])
def test_two_gpu_layout_matches_one_gpu(numerics, layout, precision, tol):
    ref, got = numerics[f"single_{precision}"], numerics[f"{layout}_{precision}"]
    assert abs(got["loss"] - ref["loss"]) <= tol * abs(ref["loss"]), (got["loss"], ref["loss"])
    err, name = _max_grad_error(got["grads"], ref["grads"])
    assert err <= tol, (name, err)
    assert all(g.abs().max() > 0 for g in ref["grads"].values())  # every parameter got a gradient


def test_negative_control_is_outside_the_tolerance(numerics):
    ref, bad = numerics["single_fp32"], numerics["shifted_fp32"]
    err, _ = _max_grad_error(bad["grads"], ref["grads"])
    # measured on the H200: max relative gradient error 0.087 (vs ≤ 3e-2 allowed in bf16, ~1e-6 seen in fp32)
    assert err > 2 * BF16_TOL and abs(bad["loss"] - ref["loss"]) > FP32_TOL * abs(ref["loss"])


# ---------------------------------------------------------------- slime train on two GPUs


def _slime_train(argv: list[str], out: Path, timeout: float = 480) -> list[dict]:
    """Run `slime train`; returns the metrics records."""
    from sim.slime_run import run_slime_train

    log_path = out.parent / f"{out.name}.log"
    rc = run_slime_train([*argv, "--metrics-dir", str(out), "--no-use-tensorboard"], log_path, timeout)
    assert rc == 0, log_path.read_text()[-6000:]
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]


def _toy_flags(toy: Path, rollouts: int = 3) -> list[str]:
    return [
        "--hf-checkpoint", str(toy / "model"), "--prompt-data", str(toy / "data" / "train.jsonl"),
        "--input-key", "input", "--label-key", "label", "--apply-chat-template",
        "--custom-rm-path", "examples.toy.reward.reverse_digits_rm", "--rollout-engine", "sim", "--sim-engine", "hf",
        "--rollout-batch-size", "8", "--n-samples-per-prompt", "4", "--global-batch-size", "32",
        "--num-rollout", str(rollouts), "--rollout-max-response-len", "16", "--rollout-temperature", "1.0",
        "--lr", "1e-4", "--seed", "1234", "--check-weight-update-equal",
    ]  # fmt: skip


def _train_records(records: list[dict]) -> list[dict]:
    return [r["metrics"] for r in records if r.get("kind") == "train"]


def test_disaggregated_training_syncs_weights_over_nccl(toy, tmp_path):
    """Trainer on GPU 0, engine on GPU 1; every sync is broadcast over NCCL and checked tensor by tensor."""
    flags = [*_toy_flags(toy), "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1"]
    recs = _train_records(_slime_train(flags, tmp_path / "disagg"))
    assert len(recs) == 3
    synced = [m for m in recs if "weight_sync/checked_tensors" in m]
    assert len(synced) == 3 and all(m["weight_sync/checked_engines"] == 1 for m in synced)
    assert all(m["weight_sync/bytes"] > 0 and m["weight_sync/send_s"] > 0 for m in synced)
    # the engine samples with the synced weights: the trainer's log-probs of its tokens agree (fp32 on GPU,
    # where the engine's HF attention and megatron's differ by kernel choice only)
    assert all(m["train/train_rollout_logprob_abs_diff_max"] < 1e-2 for m in recs), recs


def test_colocated_ppo_dp2_reports_every_rank(toy, tmp_path):
    """Actor, critic and one engine time-share each of the two GPUs; both ranks report their phase peaks."""
    flags = [
        *_toy_flags(toy), "--colocate", "--bf16", "--advantage-estimator", "ppo", "--actor-num-nodes", "1",
        "--actor-num-gpus-per-node", "2",
    ]  # fmt: skip
    recs = _train_records(_slime_train(flags, tmp_path / "ppo_dp2"))
    assert len(recs) == 3
    last = recs[-1]
    for phase in ("critic_values", "critic_train", "actor_log_probs", "actor_train"):
        assert last[f"memory/{phase}_peak_bytes"] > 0 and last[f"memory/rank1/{phase}_peak_bytes"] > 0
    assert last["weight_sync/checked_engines"] == 2


def test_sglang_config_two_engines_one_router(toy, tmp_path):
    """A --sglang-config topology: one model, two 1-GPU engines on GPUs 0 and 1 behind one router, 3 rollouts."""
    cfg = tmp_path / "topology.yaml"
    cfg.write_text("sglang:\n  - name: actor\n    server_groups:\n      - worker_type: regular\n        num_gpus: 2\n")
    logs = tmp_path / "engine_logs"
    logs.mkdir()
    flags = [
        *_toy_flags(toy), "--colocate", "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "2",
        "--sglang-config", str(cfg), "--sim-request-log-dir", str(logs), "--router-policy", "round_robin",
    ]  # fmt: skip
    recs = _train_records(_slime_train(flags, tmp_path / "topology"))
    assert len(recs) == 3 and all(m["weight_sync/checked_engines"] == 2 for m in recs)
    served = {}
    for f in sorted(logs.glob("engine_*.jsonl")):
        lines = [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
        served[f.stem] = sum(1 for x in lines if x["endpoint"] == "/generate" and x["status"] == 200)
    assert len(served) == 2 and all(n > 0 for n in served.values()), served
