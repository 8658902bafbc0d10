"""Weight gradients accumulated straight into megatron's fp32 `main_grad`, without Apex.

Why: without `gradient_accumulation_fusion` every megatron linear's backward writes its weight gradient as a new
bf16 tensor, and the DDP hook then adds it into the fp32 `main_grad` buffer: one more read and write of every
weight per micro-batch (~7 ms per 4096-token micro-batch of a 1.8B model on an H200), plus the allocation. With the
fusion megatron calls Apex's `fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32`, a GEMM with β = 1 into the
fp32 buffer. torch's `addmm(..., out_dtype=float32)` is that GEMM (bf16 inputs, fp32 accumulator and output), so
`use_wgrad_accumulation_fusion` gives megatron an object with Apex's two entry points when Apex is absent.
"""

from __future__ import annotations

import logging
import types

import torch

logger = logging.getLogger(__name__)


def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """main_grad (fp32) += grad_output.T @ total_input, accumulated in fp32 (Apex's signature)."""
    if main_grad.is_cuda and total_input.dtype != torch.float32:
        torch.addmm(main_grad, grad_output.t(), total_input, out_dtype=torch.float32, out=main_grad)
    else:  # fp32 training, or a CPU copy of a model built on a GPU host: the plain arithmetic
        main_grad.addmm_(grad_output.t().float(), total_input.float())


def wgrad_gemm_accum_fp16(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """main_grad (bf16/fp16, as the inputs) += grad_output.T @ total_input (Apex's signature)."""
    main_grad.addmm_(grad_output.t(), total_input)


_SHIM = types.SimpleNamespace(wgrad_gemm_accum_fp32=wgrad_gemm_accum_fp32, wgrad_gemm_accum_fp16=wgrad_gemm_accum_fp16)
_usable: bool | None = None


def _probe() -> bool:
    """torch's fp32-output GEMM of bf16 inputs works on this GPU and accumulates exactly like fp32 arithmetic."""
    try:
        g = torch.Generator(device="cuda").manual_seed(0)
        a = torch.randn(64, 32, device="cuda", generator=g).bfloat16()
        b = torch.randn(64, 48, device="cuda", generator=g).bfloat16()
        acc = torch.randn(32, 48, device="cuda", generator=g)
        want = acc + a.t().float() @ b.float()
        wgrad_gemm_accum_fp32(b, a, acc)
        return torch.allclose(acc, want, rtol=1e-4, atol=1e-4)
    except (RuntimeError, TypeError) as e:
        logger.info("no fp32-output bf16 GEMM in this torch (%s): weight gradients are added unfused", e)
        return False


def use_wgrad_accumulation_fusion() -> bool:
    """Whether megatron linears built now may use `gradient_accumulation_fusion` (CUDA only); installs the shim
    into megatron when Apex's extension is missing."""
    global _usable
    if not torch.cuda.is_available():
        return False
    from megatron.core.tensor_parallel import layers

    if layers._grad_accum_fusion_available and getattr(layers, "fused_weight_gradient_mlp_cuda", None) is not _SHIM:
        return True  # Apex's own kernels
    if _usable is None:
        _usable = _probe()
    if _usable:
        layers.fused_weight_gradient_mlp_cuda = _SHIM
        layers._grad_accum_fusion_available = True
    return _usable
