"""Patch the pack's sgl_kernel/elementwise.py: rmsnorm and fused_add_rmsnorm on the precompiled sm90 common_ops.

Upstream sgl_kernel 0.4.5 sends rmsnorm / fused_add_rmsnorm (and the gemma variants) to `flashinfer.norm`
whenever flashinfer imports. That norm is JIT-built with nvcc at first use and needs cuBLAS and cuRAND headers
(cublasLt.h, curand_kernel.h) and an unversioned libcuda.so to link, which a GPU host with only nvcc and the
pip nvidia-* runtime packages may lack. The kernels in sgl_kernel's own common_ops are the same algorithm
(derived from flashinfer's) and need no compiler. Setting SGLPACK_FLASHINFER_NORM=1 in the environment of
the server process restores the upstream behaviour.

Usage: python3 patch_sgl_kernel.py PATH/TO/sgl_kernel/elementwise.py  (idempotent)
"""

import sys

MARK = "SGLPACK_FLASHINFER_NORM"
UPSTREAM = """try:
    import flashinfer.norm as _flashinfer_norm

    _has_flashinfer = True
except ImportError:
    _has_flashinfer = False
"""
PATCHED = """import os as _os

# Offline pack: use the precompiled common_ops norms unless SGLPACK_FLASHINFER_NORM=1 (upstream: flashinfer.norm,
# JIT-built with nvcc at first use). See scripts/sglang_pack/patch_sgl_kernel.py in the slime repository.
_has_flashinfer = False
if _os.environ.get("SGLPACK_FLASHINFER_NORM") == "1":
    try:
        import flashinfer.norm as _flashinfer_norm

        _has_flashinfer = True
    except ImportError:
        _has_flashinfer = False
"""


def main(path: str) -> int:
    with open(path, encoding="utf-8") as f:
        src = f.read()
    if MARK in src:
        return 0
    if src.count(UPSTREAM) != 1:
        print(f"patch_sgl_kernel: the flashinfer.norm import block was not found in {path}", file=sys.stderr)
        return 1
    with open(path, "w", encoding="utf-8") as f:
        f.write(src.replace(UPSTREAM, PATCHED))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
