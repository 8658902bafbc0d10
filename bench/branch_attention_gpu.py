"""Core attention of a shared-prompt micro-batch on one GPU: which SDPA kernel a branch gets, and what it costs.

A branch of a shared prompt (packing.py) attends to the whole prompt and causally to itself: a bottom-right
causal mask over [prompt + own] keys, which slime's core attention passes as a boolean tensor. A tensor mask
rules out the flash kernel, and GQA rules out the efficient one: had CUDA's SDPA fallen back to the math kernel,
it would materialise [n, heads, len_q, len_kv] scores. This bench checks which kernels accept a branch bucket,
and runs one layer's core attention, forward and backward, on packed rows of GRPO- and agent-like samples:
shared with the boolean mask (what slime does), shared with `causal_lower_right` (torch's CausalBias, flash
-eligible), and unshared. It reports time and peak memory, and how far the two mask forms' outputs and
gradients differ.

Usage (GPU host): python -m bench.branch_attention_gpu --out bench/results/branch_attention_gpu.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig
from torch.nn.attention.bias import causal_lower_right
from tqdm import tqdm

from slime.backends.megatron import attention
from slime.backends.megatron.packing import pack_samples

# (query heads, KV heads, head dim): Qwen2.5-7B's attention
HEADS, GROUPS, HN = 28, 4, 128
CASES = [
    # (name, prompts, branches per prompt, prompt length, response lengths cycle)
    ("grpo 8x(2k+512)", 2, 8, 2048, [512]),
    ("grpo 8x(4k+1k), uneven", 1, 8, 4096, [1024, 960, 896, 1024]),
    ("agent 16x(8k+256)", 1, 16, 8192, [256]),
]


def _core() -> attention.SDPACoreAttention:
    cfg = TransformerConfig(
        num_layers=1,
        hidden_size=HEADS * HN,
        num_attention_heads=HEADS,
        num_query_groups=GROUPS,
        attention_dropout=0.0,
        bf16=True,
        params_dtype=torch.bfloat16,
    )
    return attention.SDPACoreAttention(cfg, 1, AttnMaskType.causal, "self").cuda()


def _row(prompts: int, branches: int, plen: int, resp: list[int], share: bool):
    g = torch.Generator().manual_seed(0)
    seqs, plens = [], []
    for _ in range(prompts):
        prompt = torch.randint(1, 30000, (plen,), generator=g).tolist()
        for b in range(branches):
            seqs.append(prompt + torch.randint(1, 30000, (resp[b % len(resp)],), generator=g).tolist())
            plens.append(plen)
    packed = pack_samples(seqs, device="cuda", prompt_lengths=plens if share else None)
    packed.packed_seq_params._slime_rope_applied = True  # the core attention alone: q/k stand for rotated ones
    return packed, sum(len(s) for s in seqs)


def _run(core, packed, variant: str, reps: int) -> dict:
    params = packed.packed_seq_params
    for attr in ("_slime_length_buckets",):
        if hasattr(params, attr):
            delattr(params, attr)
    plan = attention._length_buckets(params, torch.device("cuda"))
    if variant == "causal bias":  # the alternative: the same bottom-right mask as torch's CausalBias
        for b in plan:
            if b.mask is not None:
                b.mask = causal_lower_right(b.len_q, b.len_kv)
    t = packed.tokens.numel()
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(t, HEADS, HN, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
    k = torch.randn(t, GROUPS, HN, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
    v = torch.randn(t, GROUPS, HN, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
    grad = torch.randn(t, HEADS * HN, device="cuda", dtype=torch.bfloat16, generator=g)
    out = None
    for _ in range(2):  # warm-up
        out = core(q, k, v, None, packed_seq_params=params)
        out.backward(grad)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    start = time.perf_counter()
    for _ in range(reps):
        q.grad = k.grad = v.grad = None
        out = core(q, k, v, None, packed_seq_params=params)
        out.backward(grad)
    torch.cuda.synchronize()
    ms = (time.perf_counter() - start) / reps * 1e3
    return {
        "ms": ms,
        "peak_gib": (torch.cuda.max_memory_allocated() - base) / 2**30,
        "out": out.detach().float(),
        "grads": [x.grad.detach().float() for x in (q, k, v)],
    }


def _kernels(packed) -> dict:
    """For the first branch bucket: which SDPA backends accept it with each mask form (GQA as in the module)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    params = packed.packed_seq_params
    b = next(b for b in attention._length_buckets(params, torch.device("cuda")) if b.mask is not None)
    n = b.rows_q.size(0)
    q = torch.randn(n, HEADS, b.len_q, HN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(n, GROUPS, b.len_kv, HN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = {}
    for form, mask in (("bool mask", b.mask), ("causal bias", causal_lower_right(b.len_q, b.len_kv))):
        ok = []
        for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION):
            try:
                with sdpa_kernel(backend):
                    torch.nn.functional.scaled_dot_product_attention(q, k, k, attn_mask=mask, enable_gqa=True)
                ok.append(backend.name)
            except RuntimeError:
                pass
        out[form] = ok or ["MATH only"]
    return out


def main() -> None:
    from bench.requires import require, require_cuda

    require(["megatron.core"], "bash scripts/install.sh (megatron-core is a main dependency)")
    require_cuda()
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default="bench/results/branch_attention_gpu.json")
    a = p.parse_args()
    core = _core()
    rows = []
    for name, prompts, branches, plen, resp in tqdm(CASES, desc="cases"):
        shared, tokens = _row(prompts, branches, plen, resp, share=True)
        plain, _ = _row(prompts, branches, plen, resp, share=False)
        kernels = _kernels(shared)
        res = {v: _run(core, shared, v, a.reps) for v in ("bool mask", "causal bias")}
        res["unshared"] = _run(core, plain, "bool mask", a.reps)
        diff = max(
            (res["causal bias"]["out"] - res["bool mask"]["out"]).abs().max().item(),
            *[
                (x - y).abs().max().item()
                for x, y in zip(res["causal bias"]["grads"], res["bool mask"]["grads"], strict=True)
            ],
        )
        rows.append(
            {
                "case": name,
                "tokens_unshared": tokens,
                "tokens_packed": int(shared.tokens.numel()),
                **{f"{v} ms": round(r["ms"], 2) for v, r in res.items()},
                **{f"{v} peak GiB": round(r["peak_gib"], 3) for v, r in res.items()},
                "max |bias - bool| (out, grads)": diff,
                "kernels": kernels,
            }
        )
        del res
        torch.cuda.empty_cache()
    for r in rows:
        print(json.dumps(r))
    print("time ratio bool mask / causal bias:", [round(r["bool mask ms"] / r["causal bias ms"], 2) for r in rows])
    print("time ratio unshared / shared:", [round(r["unshared ms"] / r["bool mask ms"], 2) for r in rows])
    with open(a.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
