"""Self-test of the offline SGLang pack (`install.sh --check` runs it through .sgl-site/bin/python).

Prints one OK/FAIL line per item: versions and where they load from (.sgl-site must win over the host and
.offline-site), the serving-path imports, and on a GPU short kernel self-tests against torch: a triton kernel,
sgl_kernel.rmsnorm / fused_add_rmsnorm (the pack's patched common_ops path, or flashinfer.norm's JIT build when
SGLPACK_FLASHINFER_NORM=1), and sglang's tvm-ffi JIT silu_and_mul (a cache hit when the prebuilt sm90 cache of
chunk 2 is installed). Exit status 1 if anything failed.
"""

import importlib
import importlib.metadata as md
import importlib.util
import os
import sys
import time

SITE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
T0 = time.time()
bad = []


def line(ok, what, detail=""):
    if not ok:
        bad.append(what)
    print(f"  {'OK  ' if ok else 'FAIL'} {what}{(' -- ' + detail) if detail else ''}", flush=True)


def where(mod):
    f = getattr(sys.modules.get(mod), "__file__", "") or ""
    return "pack" if os.path.realpath(f).startswith(os.path.realpath(SITE) + os.sep) else (f or "?")


print(f"python {sys.version.split()[0]} ({sys.executable}); site {SITE}")
for dist in [
    "torch",
    "triton",
    "sglang",
    "sglang-kernel",
    "flashinfer-python",
    "apache-tvm-ffi",
    "xgrammar",
    "transformers",
    "tokenizers",
    "torch_memory_saver",
    "pydantic",
    "pydantic-core",
    "fastapi",
    "uvicorn",
]:
    try:
        print(f"  {dist}=={md.version(dist)}")
    except md.PackageNotFoundError:
        line(False, f"{dist} not found")

print("imports:")
MODULES = [
    "transformers",
    "pydantic",
    "pydantic_core",
    "fastapi",
    "sgl_kernel",
    "flashinfer",
    "xgrammar",
    "tvm_ffi",
    "torch_memory_saver",
    "sglang.launch_server",
    "sglang.srt.server_args",
    "sglang.srt.entrypoints.http_server",
    "sglang.srt.entrypoints.openai.serving_chat",
    "sglang.srt.managers.scheduler",
    "sglang.srt.managers.tokenizer_manager",
    "sglang.srt.managers.detokenizer_manager",
    "sglang.srt.managers.tp_worker",
    "sglang.srt.model_executor.model_runner",
    "sglang.srt.models.qwen2",
    "sglang.srt.models.qwen3",
    "sglang.srt.models.llama",
    "sglang.srt.layers.attention.triton_backend",
    "sglang.srt.constrained.xgrammar_backend",
    "sglang.srt.weight_sync.utils",
]
for m in MODULES:
    t = time.time()
    try:
        importlib.import_module(m)
        line(True, f"import {m}", f"{time.time() - t:.1f} s")
    except BaseException as e:  # noqa: BLE001 - SystemExit from import-time code counts too
        line(False, f"import {m}", f"{type(e).__name__}: {str(e)[:400]}")
for m in ["transformers", "tokenizers", "pydantic", "pydantic_core", "fastapi", "starlette", "uvicorn"]:
    if m in sys.modules or importlib.util.find_spec(m):
        importlib.import_module(m)
        line(where(m) == "pack", f"{m} from .sgl-site", where(m))

import torch  # noqa: E402

if not torch.cuda.is_available():
    print("  (no CUDA device: kernel self-tests skipped)")
    sys.exit(1 if bad else 0)
print(
    f"gpu: {torch.cuda.get_device_name()} sm{''.join(map(str, torch.cuda.get_device_capability()))}, "
    f"torch CUDA {torch.version.cuda}"
)


def kernel(what, fn):
    t = time.time()
    try:
        detail = fn() or ""
        torch.cuda.synchronize()
        line(True, what, f"{detail} {time.time() - t:.1f} s".strip())
    except BaseException as e:  # noqa: BLE001
        line(False, what, f"{type(e).__name__}: {str(e)[:600]}")


def t_triton():
    import triton
    import triton.language as tl

    @triton.jit
    def add(a, b, o, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        tl.store(o + i, tl.load(a + i, mask=m) + tl.load(b + i, mask=m), mask=m)

    a = torch.randn(1000, device="cuda")
    o = torch.empty_like(a)
    add[(4,)](a, a, o, 1000, BLOCK=256)
    torch.testing.assert_close(o, 2 * a)


def ref_rms(x, w, eps=1e-6):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


def t_rmsnorm():
    import sgl_kernel
    import sgl_kernel.elementwise as ew

    x = torch.randn(8, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(1024, device="cuda", dtype=torch.bfloat16) + 0.5
    torch.testing.assert_close(sgl_kernel.rmsnorm(x, w, 1e-6), ref_rms(x, w), atol=3e-2, rtol=3e-2)
    r = torch.randn_like(x)
    want_r = (x.float() + r.float()).to(x.dtype)
    want = ref_rms(want_r, w)
    x2, r2 = x.clone(), r.clone()
    sgl_kernel.fused_add_rmsnorm(x2, r2, w, 1e-6)
    torch.testing.assert_close(r2, want_r, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(x2, want, atol=5e-2, rtol=5e-2)
    return "path: " + ("flashinfer.norm (JIT)" if ew._has_flashinfer else "common_ops sm90 (pack patch)")


def t_jit():
    from sglang.kernels.ops.activation.activation import silu_and_mul

    cache = os.environ.get("TVM_FFI_CACHE_DIR", "")
    hit = (
        any(d.startswith("sgl_kernel_jit_activation_bf16") for d in os.listdir(cache))
        if os.path.isdir(cache)
        else False
    )
    x = torch.randn(16, 512, device="cuda", dtype=torch.bfloat16)
    y = silu_and_mul(x)
    ref = (torch.nn.functional.silu(x[:, :256].float()) * x[:, 256:].float()).to(x.dtype)
    torch.testing.assert_close(y, ref, atol=3e-2, rtol=3e-2)
    return "prebuilt cache hit" if hit else f"built now with nvcc into {cache}"


kernel("triton vector add (triton builds its launcher: gcc + Python.h)", t_triton)
kernel("sgl_kernel rmsnorm + fused_add_rmsnorm vs torch", t_rmsnorm)
kernel("sglang JIT silu_and_mul bf16 (tvm-ffi) vs torch", t_jit)
print(f"check: {'all OK' if not bad else str(len(bad)) + ' FAILED: ' + ', '.join(bad)} ({time.time() - T0:.0f} s)")
sys.exit(1 if bad else 0)
