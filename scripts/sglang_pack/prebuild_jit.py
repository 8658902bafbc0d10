"""Prebuild sglang's tvm-ffi JIT kernels of the dense Qwen2/Llama path for sm90, on a machine without a GPU.

Run by scripts/sglang_pack/build.sh as `PYTHONPATH=<staged site> TVM_FFI_CACHE_DIR=<dir> python prebuild_jit.py`
with a CPython 3.12 that has torch 2.11 and nvcc 13 on PATH. sglang's `load_jit` keys a build by module name
(kernel, template arguments and a hash of the sources), target arch and tvm-ffi version, and loads
`$TVM_FFI_CACHE_DIR/<key>/<module>.so` without a compiler when that file exists, so modules built here for
arch 9.0a are what the H200 would build at first use.

Built: activation (silu/gelu-and-mul) fp16+bf16; fused_rope (neox) rope_dim 64 and 128, fp16+bf16;
rotary_embedding; kvcache store for K/V rows of 256/512/1024/2048 bytes (kv heads x head_dim x 2 B per TP
rank: e.g. 2x64, 2x128, 4x128, 8x128); clamp_position int32+int64.
"""

from __future__ import annotations

import os
import shutil
import sys
import time


def cuda_home() -> str | None:
    """A toolkit root with bin/nvcc and include/cuda_runtime.h (an nvcc wrapper script on PATH is not one)."""
    cands = [os.environ.get("CUDA_HOME"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        cands.insert(1, os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    for c in cands:
        if (
            c
            and os.path.exists(os.path.join(c, "bin", "nvcc"))
            and os.path.exists(os.path.join(c, "include", "cuda_runtime.h"))
        ):
            return c
    return None


def main() -> int:
    home = cuda_home()
    if home is None:
        print("prebuild_jit: no CUDA toolkit (bin/nvcc + include/cuda_runtime.h) found", file=sys.stderr)
        return 1
    os.environ["CUDA_HOME"] = home
    import torch
    from sglang.kernels.jit.utils import override_jit_cuda_arch

    built, failed = [], []
    with override_jit_cuda_arch(9, 0):
        # imported inside the override: is_arch_support_pdl() is cached at its first call
        from sglang.kernels.ops.activation.activation import activation_module
        from sglang.kernels.ops.attention.clamp_position import _jit_clamp_position_module
        from sglang.kernels.ops.attention.rope import _jit_fused_rope_module, _jit_rotary_embedding_module
        from sglang.kernels.ops.kvcache.kvcache import _jit_kvcache_module

        jobs = []
        for dt in (torch.bfloat16, torch.float16):
            jobs.append((f"activation {dt}", activation_module, (dt,)))
            for rope_dim in (64, 128):
                jobs.append((f"fused_rope neox {rope_dim} {dt}", _jit_fused_rope_module, (True, rope_dim, dt, dt)))
        jobs.append(("rotary_embedding", _jit_rotary_embedding_module, ()))
        for row in (256, 512, 1024, 2048):
            jobs.append((f"kvcache row {row} B", _jit_kvcache_module, (row, row)))
        for dt in (torch.int32, torch.int64):
            jobs.append((f"clamp_position {dt}", _jit_clamp_position_module, (dt,)))
        for name, fn, args in jobs:
            t = time.time()
            try:
                fn(*args)
                built.append(name)
                print(f"prebuild_jit: built {name} ({time.time() - t:.0f} s)", flush=True)
            except Exception as e:  # noqa: BLE001 - report and go on: a missing module only costs a GPU-side build
                failed.append(name)
                print(f"prebuild_jit: FAILED {name}: {type(e).__name__}: {str(e)[:800]}", file=sys.stderr, flush=True)
    print(f"prebuild_jit: {len(built)} built, {len(failed)} failed, CUDA_HOME={home}")
    return 0 if built else 1


if __name__ == "__main__":
    sys.exit(main())
