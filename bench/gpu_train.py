"""Training-step throughput (MFU) of slime's megatron-core model on one GPU (bf16, packed THD batches, SDPA core
attention, megatron's distributed optimizer).

MFU = (6·(N − V·h)·T + 6·L·h·s·T) / (step time · peak), matmul FLOPs only (`bench/mfu.py`: the input embedding is a
lookup, not a matmul): 6 FLOPs per matmul parameter and token for forward + backward, plus causal attention over
packed samples of length s; peak 989e12 (H100/H200 dense bf16), the hardware floor the table's ratio is taken
against; tokens/s beside it. A step is `--micro-batches` packed micro-batches of `--seq` tokens (gradient
accumulation) and one optimizer step. The Adam implementation is compared: torch's `foreach` AdamW (what
megatron-core falls back to without TransformerEngine/Apex) and torch's `fused` AdamW (the trainer's).

Model variants (`--variant`): `fp32-norms` — every RMSNorm weight in fp32 against bf16 activations (how the
trainer built them before: torch's fused RMSNorm refuses mixed dtypes); `trainer` — the model as `slime train`
builds it (weight gradients accumulated into the fp32 main grads inside the GEMM, RoPE applied without per-sample
host syncs); `before-fusions` — the trainer without those two (megatron's unfused gradient add and THD RoPE);
`fused` — plus megatron's SwiGLU and bias-dropout-add fusions (`torch.compile`d on first use).
Micro-batch sizes (`--seq`, several allowed): tokens per packed micro-batch; with `--sample-len` each micro-batch
holds seq / sample-len samples of that length (RL micro-batches packed up to `--max-tokens-per-gpu`).
Losses (`--loss`): `ce` — full-vocabulary fp32 cross-entropy; `logprob` — what the trainer computes, the
log-probability of each token through `vocab_parallel_logprobs_and_entropy` in chunks of `--chunk` rows (no
[tokens, vocab] fp32 tensor). `--profile` adds a torch.profiler table of the last configuration's kernels.

    export PYTHONPATH=$PWD/.gpu-site:$PWD
    python -m bench.gpu_train --model 1.8B 0.5B --adam fused --micro-batches 4 --seq 4096 16384 --sample-len 4096 \
        --variant before-fusions trainer --loss logprob --out $OUT/gpu_train.json

Prints a table and writes JSON (after every configuration).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from typing import Any

import torch

from bench.mfu import PEAK, SHAPES, train_flops
from slime.utils.http_utils import find_free_port


def use_adam(opt: Any, impl: str) -> None:
    """Switch the torch AdamW under megatron's optimizer between `foreach` and `fused` (step counters on the GPU,
    as torch's fused kernel wants them)."""
    for sub in getattr(opt, "chained_optimizers", None) or [opt]:
        inner = sub.optimizer
        for group in inner.param_groups:
            group["fused"], group["foreach"] = impl == "fused", impl == "foreach"
            for p in group["params"]:
                st = inner.state.get(p)
                if st and "step" in st:
                    dev = p.device if impl == "fused" else "cpu"
                    st["step"] = st["step"].to(device=dev, dtype=torch.float32)


def build(args: Any, spec: Any, variant: str) -> Any:
    """The model of one `--variant`, on the GPU."""
    from megatron.core.transformer import attention

    from slime.backends.megatron import rope
    from slime.backends.megatron.model_provider import RMSNorm, build_gpt_model, build_transformer_config

    fusions = {"bias_activation_fusion": True, "bias_dropout_fusion": True} if variant == "fused" else {}
    if variant == "before-fusions":
        fusions = {"gradient_accumulation_fusion": False}
    model = build_gpt_model(args, spec, config=build_transformer_config(args, spec, **fusions)).cuda()
    # process-wide, like megatron's own function: set for this variant's run
    attention.apply_rotary_pos_emb = (
        rope._megatron_apply_rotary_pos_emb if variant == "before-fusions" else rope.apply_packed_rope
    )
    if variant == "fp32-norms":
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.float()
    return model


def loss_of(logits: Any, tokens: Any, loss: str, chunk: int) -> Any:
    if loss == "ce":
        return torch.nn.functional.cross_entropy(logits[0].float(), tokens[0])
    from slime.algorithms.logprobs import vocab_parallel_logprobs_and_entropy

    logp, _ = vocab_parallel_logprobs_and_entropy(logits[0], tokens[0], None, with_entropy=False, chunk_size=chunk)
    return -logp.mean()


def run(model_name: str, adam: str, micro_batches: int, a: argparse.Namespace, variant: str = "trainer",
        loss: str = "ce", profile: bool = False, seq: int = 4096, samples_per_mb: int = 1) -> dict[str, Any]:  # fmt: skip
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from slime.arguments import default_args
    from slime.backends.megatron.hf_config import read_hf_config
    from slime.backends.megatron.initialize import init_distributed, init_megatron
    from slime.backends.megatron.packing import pack_samples

    hidden, layers, heads, kv, ffn, vocab = SHAPES[model_name]
    d = tempfile.mkdtemp()
    cfg = {"model_type": "qwen2", "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
           "num_key_value_heads": kv, "intermediate_size": ffn, "vocab_size": vocab, "rms_norm_eps": 1e-6,
           "rope_theta": 1e6, "tie_word_embeddings": False, "max_position_embeddings": 32768,
           "hidden_act": "silu"}  # fmt: skip
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    args = default_args(hf_checkpoint=d, bf16=True)  # one GPU, no parallelism: the parser's defaults
    if not torch.distributed.is_initialized():
        init_distributed(args, 0, 1, "127.0.0.1", find_free_port())
    init_megatron(args)
    spec = read_hf_config(d)
    model = build(args, spec, variant)
    n_params = sum(p.numel() for p in model.parameters())
    ddp = DistributedDataParallel(
        config=model.config,
        ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True),
        module=model,
    )
    opt = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam", lr=1e-5, bf16=True, params_dtype=torch.bfloat16, use_distributed_optimizer=True
        ),
        [ddp],
    )
    use_adam(opt, adam)
    per = seq // samples_per_mb
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(micro_batches):
        samples = [torch.randint(0, vocab, (per,), generator=g).tolist() for _ in range(samples_per_mb)]
        batches.append(pack_samples(samples, device="cuda"))
    torch.cuda.reset_peak_memory_stats()
    times, phases = [], []
    for step in range(a.steps + 2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        ddp.zero_grad_buffer()
        opt.zero_grad()
        for packed in batches:
            logits = ddp(packed.tokens, packed.position_ids, None, packed_seq_params=packed.packed_seq_params)
            (loss_of(logits, packed.tokens, loss, a.chunk) / micro_batches).backward()
        ddp.finish_grad_sync()
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        opt.step()
        torch.cuda.synchronize()
        if step >= 2:  # warm-up steps excluded
            times.append(time.perf_counter() - t0)
            phases.append((t1 - t0, time.perf_counter() - t1))
    kernels = profile_step(ddp, opt, batches, loss, a) if profile else None
    t = sorted(times)[len(times) // 2]
    fwd_bwd, opt_t = (sorted(x)[len(x) // 2] for x in zip(*phases, strict=True))
    tokens = seq * micro_batches
    flops = train_flops(n_params, vocab=vocab, hidden=hidden, layers=layers, sample_len=per, tokens=tokens)
    row = {"model": model_name, "variant": variant, "loss": loss, "adam": adam, "micro_batches": micro_batches, "params": n_params, "seq": seq,
           "samples_per_mb": samples_per_mb, "step_s_median": t, "tokens_per_s": tokens / t,
           "mfu": flops / t / PEAK, "gpu": torch.cuda.get_device_name(),
           "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30, "forward_backward_s": fwd_bwd,
           "optimizer_s": opt_t, "mfu_fwd_bwd_only": flops / fwd_bwd / PEAK}  # fmt: skip
    if kernels is not None:
        row["kernels"] = kernels
    del opt, ddp, model, batches
    torch.cuda.empty_cache()
    return row


def profile_step(ddp: Any, opt: Any, batches: list[Any], loss: str, a: argparse.Namespace) -> list[dict[str, Any]]:
    """One more step under torch.profiler: CUDA time per kernel name (top 25), GEMMs summed apart; printed."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        ddp.zero_grad_buffer()
        opt.zero_grad()
        for packed in batches:
            logits = ddp(packed.tokens, packed.position_ids, None, packed_seq_params=packed.packed_seq_params)
            (loss_of(logits, packed.tokens, loss, a.chunk) / len(batches)).backward()
        ddp.finish_grad_sync()
        opt.step()
        torch.cuda.synchronize()
    rows = [{"name": e.key[:90], "cuda_ms": e.device_time_total / 1e3, "calls": e.count}
            for e in prof.key_averages() if e.device_time_total > 0]  # fmt: skip
    rows.sort(key=lambda r: -r["cuda_ms"])
    total = sum(r["cuda_ms"] for r in rows)
    gemm = sum(r["cuda_ms"] for r in rows if any(k in r["name"].lower() for k in ("gemm", "cutlass", "sm90", "nvjet")))
    print(f"kernels of one step: {total:.1f} ms of CUDA time, GEMM-like {gemm:.1f} ms ({gemm / max(total, 1e-9):.0%})")
    for r in rows[:25]:
        print(f"  {r['cuda_ms']:8.2f} ms {r['calls']:6d}x  {r['name']}")
    return rows[:40]


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    from bench.requires import require, require_cuda

    require(["megatron.core"], "bash scripts/install.sh (megatron-core is a main dependency)")
    require_cuda()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", nargs="+", choices=sorted(SHAPES), default=["1.8B"])
    p.add_argument("--adam", nargs="+", choices=["foreach", "fused"], default=["foreach", "fused"])
    p.add_argument("--micro-batches", nargs="+", type=int, default=[1, 4], help="per optimizer step")
    p.add_argument("--seq", nargs="+", type=int, default=[4096], help="tokens per packed micro-batch")
    p.add_argument("--samples-per-mb", type=int, default=1, help="samples per micro-batch (without --sample-len)")
    p.add_argument("--sample-len", type=int, default=None, help="tokens per sample: seq / sample-len per micro-batch")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument(
        "--variant", nargs="+", choices=["fp32-norms", "before-fusions", "trainer", "fused"], default=["trainer"]
    )
    p.add_argument("--loss", nargs="+", choices=["ce", "logprob"], default=["ce"])
    p.add_argument("--chunk", type=int, default=1024, help="rows per log-prob chunk (--loss logprob)")
    p.add_argument("--profile", action="store_true", help="profile the last configuration's kernels")
    p.add_argument("--out", default="bench/results/gpu_train.json")
    a = p.parse_args(argv)
    rows = []
    for seq in a.seq:
        if a.sample_len and seq % a.sample_len:
            p.error(f"--seq {seq} is not a multiple of --sample-len {a.sample_len}")
    print(f"{'model':>6} {'variant':>14} {'loss':>7} {'adam':>8} {'mb tokens':>9} {'samples':>7} {'mbs':>4} "
          f"{'step s':>8} {'fwd+bwd s':>10} {'opt s':>7} {'tok/s':>9} {'MFU':>6} {'×floor':>7} {'MFU w/o opt':>11}",
          flush=True)  # fmt: skip
    configs = [(m, seq, mbs, adam, v, loss) for m in a.model for seq in a.seq for mbs in a.micro_batches
               for adam in a.adam for v in a.variant for loss in a.loss]  # fmt: skip
    for i, (model_name, seq, mbs, adam, variant, loss) in enumerate(configs):
        spm = seq // a.sample_len if a.sample_len else a.samples_per_mb
        r = run(model_name, adam, mbs, a, variant, loss, profile=a.profile and i == len(configs) - 1, seq=seq,
                samples_per_mb=spm)  # fmt: skip
        rows.append(r)
        print(f"{model_name:>6} {variant:>14} {loss:>7} {adam:>8} {seq:>9} {spm:>7} {mbs:>4} {r['step_s_median']:>8.3f} "
              f"{r['forward_backward_s']:>10.3f} {r['optimizer_s']:>7.3f} {r['tokens_per_s']:>9.0f} {r['mfu']:>6.1%} "
              f"{1 / r['mfu']:>7.2f} {r['mfu_fwd_bwd_only']:>11.1%}", flush=True)  # fmt: skip
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
