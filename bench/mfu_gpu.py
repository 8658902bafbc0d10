"""Training-step MFU of slime's megatron-core model on one GPU (bf16, packed THD batches, SDPA core attention).

MFU = (6·N·T + 6·L·H·s·T) / (step time · peak): 6 FLOPs per parameter and token for forward + backward, plus
causal attention over packed samples of length s; peak 989e12 (H100/H200 dense bf16).
Prints a table and writes JSON. Usage (GPU host): python bench/mfu_gpu.py --out bench/results/mfu_gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch

from slime.utils.http_utils import find_free_port

PEAK = 989e12
SHAPES = {
    # Qwen2-shaped models (hidden, layers, heads, kv heads, ffn, vocab)
    "1.8B": (2048, 24, 16, 16, 5504, 151936),
    "0.5B": (1024, 24, 16, 16, 2816, 151936),
}


def main() -> None:
    from bench.requires import require, require_cuda

    require(["megatron.core"], "bash scripts/install.sh (megatron-core is a main dependency)")
    require_cuda()
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=sorted(SHAPES), default="1.8B")
    p.add_argument("--seq", type=int, default=4096, help="tokens per packed micro-batch")
    p.add_argument("--samples-per-mb", type=int, default=4)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--out", default="bench/results/mfu_gpu.json")
    a = p.parse_args()
    hidden, layers, heads, kv, ffn, vocab = SHAPES[a.model]
    d = tempfile.mkdtemp()
    cfg = {"model_type": "qwen2", "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
           "num_key_value_heads": kv, "intermediate_size": ffn, "vocab_size": vocab, "rms_norm_eps": 1e-6,
           "rope_theta": 1e6, "tie_word_embeddings": False, "max_position_embeddings": 32768,
           "hidden_act": "silu"}  # fmt: skip
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from slime.arguments import default_args
    from slime.backends.megatron.hf_config import read_hf_config
    from slime.backends.megatron.initialize import init_distributed, init_megatron
    from slime.backends.megatron.model_provider import build_gpt_model
    from slime.backends.megatron.packing import pack_samples

    args = default_args(hf_checkpoint=d, bf16=True)  # one GPU, no parallelism: the parser's defaults
    init_distributed(args, 0, 1, "127.0.0.1", find_free_port())
    init_megatron(args)
    spec = read_hf_config(d)
    model = build_gpt_model(args, spec).cuda()
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
    per = a.seq // a.samples_per_mb
    g = torch.Generator().manual_seed(0)
    samples = [torch.randint(0, vocab, (per,), generator=g).tolist() for _ in range(a.samples_per_mb)]
    packed = pack_samples(samples, device="cuda")
    times, phases = [], []
    for step in range(a.steps + 2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        ddp.zero_grad_buffer()
        opt.zero_grad()
        logits = ddp(packed.tokens, packed.position_ids, None, packed_seq_params=packed.packed_seq_params)
        loss = torch.nn.functional.cross_entropy(logits[0].float(), packed.tokens[0])
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        loss.backward()
        ddp.finish_grad_sync()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        opt.step()
        torch.cuda.synchronize()
        if step >= 2:  # warm-up steps excluded
            times.append(time.perf_counter() - t0)
            phases.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
    t = sorted(times)[len(times) // 2]
    fwd, bwd, opt_t = (sorted(x)[len(x) // 2] for x in zip(*phases, strict=True))
    tokens = a.seq
    # attention FLOPs of packed causal samples: 6·L·H·s·T with s the per-sample length
    flops = 6 * n_params * tokens + 6 * layers * hidden * per * tokens
    mfu = flops / t / PEAK
    row = {"model": a.model, "params": n_params, "seq": a.seq, "samples_per_mb": a.samples_per_mb,
           "step_s_median": t, "tokens_per_s": tokens / t, "mfu": mfu, "gpu": torch.cuda.get_device_name(),
           "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30, "forward_s": fwd, "backward_s": bwd,
           "optimizer_s": opt_t, "mfu_fwd_bwd_only": flops / (fwd + bwd) / PEAK}  # fmt: skip
    print(f"{'model':>6} {'params':>12} {'seq':>6} {'step s':>8} {'tok/s':>10} {'MFU':>6}")
    print(f"{a.model:>6} {n_params:>12,} {a.seq:>6} {t:>8.3f} {tokens / t:>10.0f} {mfu:>6.1%}")
    print(
        f"forward {fwd:.3f}s  backward {bwd:.3f}s  optimizer {opt_t:.3f}s  MFU without optimizer {row['mfu_fwd_bwd_only']:.1%}"
    )
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(row, f, indent=1)


if __name__ == "__main__":
    main()
