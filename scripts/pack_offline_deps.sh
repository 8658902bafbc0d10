#!/usr/bin/env bash
# Wheels for a GPU host without network access, fetched on a machine that has it.
#
# A GPU host usually brings its own CUDA torch, transformers and the common libraries; what slime adds on top
# is packed here in two sets (each small enough to copy on its own):
#   core    -> OUTDIR (default .offline-core):   megatron-core, torch-memory-saver, ray
#   router  -> OUTDIR (default .offline-router): sglang-router and the packages its launcher imports
# Each OUTDIR gets an install.sh; on the GPU host, from the repository root:
#   source .offline-core/install.sh && source .offline-router/install.sh
# installs them into .offline-site/ and puts it (and the repository) on PYTHONPATH.
# A third set, sglang (OUTDIR default .offline-sglang), is SGLang itself for the server processes only; it is
# built by its own block below and installed by OUTDIR/install.sh into .sgl-site/ (docs/offline_gpu.md).
# Usage: bash scripts/pack_offline_deps.sh [core|router] [OUTDIR] [--python-version 3.12]
#        bash scripts/pack_offline_deps.sh sglang [OUTDIR]
set -euo pipefail
set_name=core
case "${1:-}" in core | router) set_name=$1; shift ;; sglang) shift; set_name=sglang ;; esac
if [ "$set_name" = sglang ]; then
  # ----------------------------------------------------------------------------------------------------------
  # sglang: SGLang 0.5.17 and the packages its HTTP server imports to serve a dense bf16 Qwen2/Llama model with
  # --attention-backend triton --sampling-backend pytorch [--enable-memory-saver], for the GPU host's CPython
  # 3.12 / torch 2.11.0+cu130 / sm90. Every wheel exact-pinned and --no-deps: the host's own packages (torch,
  # triton, numpy, huggingface-hub, ... see docs/offline_gpu.md) are not packed. The pins were found by an
  # import walk of the serving path (scripts/sglang_pack/cpu_verify.py --walk): a package here is imported at
  # module level on that path, or is a hard dependency of one that is (jiter/distro/sniffio for openai,
  # pycparser for cffi).
  # Output: OUTDIR/cN/{site-N.tar.xz,PACK_ID,MANIFEST.sha256}, each chunk <= 60 MB (c1: everything the server
  # needs to start; c2: the prebuilt JIT cache and lazily loaded extras), OUTDIR/install.sh and OUTDIR/pack/.
  # Build machine needs: python3 with pip, network to PyPI, xz, binutils (strip); optionally SGLPACK_JIT_PYTHON
  # (a CPython 3.12 with torch 2.11) and nvcc 13.0 to prebuild the sm90 JIT cache (skipped without them).
  sglang_pkgs=(
    # sglang and its pinned kernels / grammar / model stack
    sglang==0.5.17 sglang-kernel==0.4.5 flashinfer-python==0.6.15.post1 apache-tvm-ffi==0.1.11 xgrammar==0.2.1
    transformers==5.12.1 tokenizers==0.22.2 torch-memory-saver==0.0.10
    # openai-compatible entrypoints (openai types, serving_chat's jsonschema, tool-call parsing)
    openai==2.6.1 jiter==0.19.0 distro==1.9.0 sniffio==1.3.1 jsonschema==4.26.0 referencing==0.37.0
    rpds-py==2026.9.1 jsonschema-specifications==2025.9.1 partial-json-parser==0.2.1.1.post7
    # web stack, all from one set so that pydantic and pydantic-core (etc.) ahead of .offline-site match
    fastapi==0.165.0 starlette==1.10.0 uvicorn==0.55.0 pydantic==2.14.4 pydantic-core==2.50.5
    annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0 opentelemetry-api==1.45.2
    python-multipart==0.0.34 orjson==3.13.0 watchfiles==1.3.0 zstandard==0.25.0
    # scheduler / tokenizer-manager IPC and utilities imported at module level
    pyzmq==27.3.0 msgspec==0.23.0 pybase64==1.5.1 setproctitle==1.3.8 dill==0.4.1
    compressed-tensors==0.20.1 loguru==0.7.3 gguf==0.19.0 soundfile==0.13.1 cffi==2.1.1 pycparser==3.12
    ipython==9.18.1 traitlets==5.16.1
  )
  # Left out of sglang 0.5.17's Requires-Dist, and why (the import walk never reaches them on this path):
  #   torch, torchaudio, torchvision, triton, numpy, numba, timm, einops, aiohttp, requests, psutil, pillow,
  #     scipy, sentencepiece, tiktoken, tqdm, uvloop, xxhash, ninja, packaging, nvidia-ml-py, prometheus-client,
  #     huggingface-hub: already on the host (its list in docs/offline_gpu.md)
  #   cuda-python: a metapackage; the host's cuda-bindings is what flashinfer imports
  #   flashinfer's cubin/jit-cache wheels, nvidia-cudnn-frontend, cuda-tile, nccl4py: flashinfer try-imports
  #     them (cuDNN attention, cuTile GEMM, NCCL comm); triton attention + pytorch sampling never use them
  #   flash-attn-4, quack-kernels, nvidia-cutlass-dsl, nvidia-mathdx, tilelang, tokenspeed_mla,
  #     sgl-deep-gemm, helion, humming-kernels: FA4 / CuTe-DSL / MLA / DSA / fp8 / MoE kernels of other paths
  #   torchao (--torchao-config only), outlines, llguidance, interegular (other grammar backends),
  #     openai-harmony (gpt-oss and /v1/responses, try-imported), anthropic (no loaded module imports it),
  #     mistral_common, modelscope, blobfile, datasets, easydict, kernels, py-spy, smg-grpc-servicer, build,
  #     torchcodec (Mistral tokenizers, ModelScope hub, Azure, benchmarks/tests, hub kernels, a CLI tool,
  #     gRPC mode, packaging, video input)
  # Removed from the wheels (scripts/sglang_pack/build.sh, recorded in .sgl-site/SGLPACK-INFO.txt):
  #   sgl_kernel/flash_ops.abi3.so (FA3, 1.1 GB; only sgl_kernel/flash_attn.py imports it), sgl_kernel/sm100/
  #   (the non-Hopper build), sgl_kernel/flashmla_ops.abi3.so (MLA, try-imported), xgrammar/lib/libxgrammar.a
  #   (static lib, 65 MB); debug info stripped from libxgrammar_bindings.so and zstandard; sgl_kernel's
  #   infllm_ops (loaded lazily, InfLLM sparse attention only) moves to chunk 2.
  # Patched: sgl_kernel/elementwise.py runs rmsnorm/fused_add_rmsnorm on its precompiled sm90 common_ops
  #   instead of flashinfer.norm (an nvcc JIT build at first use that needs cuBLAS/cuRAND headers and an
  #   unversioned libcuda.so); SGLPACK_FLASHINFER_NORM=1 restores upstream behaviour.
  out=${1:-.offline-sglang}
  here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
  exec bash "$here/sglang_pack/build.sh" "$out" "${sglang_pkgs[@]}"
fi
out=${1:-.offline-$set_name}
[ $# -gt 0 ] && shift
pyver=3.12
if [ "${1:-}" = "--python-version" ]; then pyver=$2; shift 2; fi
mkdir -p "$out"

# versions as pinned in pyproject.toml; the web stack as the sglang set pins it (one pydantic on the host)
core=(megatron-core==0.16.1 torch-memory-saver==0.0.10 jsonschema==4.26.0 referencing==0.37.0 rpds-py==2026.9.1
      jsonschema-specifications==2025.9.1)
router=(sglang-router==0.3.2 setproctitle==1.3.8 orjson==3.13.0 uvicorn==0.55.0 fastapi==0.165.0 starlette==1.10.0
        pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
        typing-extensions==4.16.0 opentelemetry-api==1.45.2 importlib-metadata==10.2.0 redis==8.1.0)
dl() {  # binary wheels for the host's interpreter and any manylinux x86_64 tag, without dependencies (the host has them)
  python3 -m pip download -q --no-deps --only-binary=:all: --implementation cp --python-version "$pyver" \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d "$1" "${@:2}"
}
# Why tar.xz and not the wheels: a device call carries at most 64 MiB in all, and both sets must travel in one
# (with the repository). Ray's wheel is 79 MB; without the jars and the libraries slime never imports (rllib, tune,
# train, serve, data, llm) and recompressed with xz -9e it is ~25 MB. The router set's wheels (34 MB, mostly the
# router's Rust extension) are ~22 MB as one xz archive of their unpacked files.
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if [ "$set_name" = core ]; then
  dl "$out" "${core[@]}"
  if [ ! -f "$out/ray.tar.xz" ]; then
    dl "$tmp/whl" ray==2.60.0
    (cd "$tmp" && python3 -m zipfile -e whl/ray-*.whl site && rm -rf site/ray/jars site/ray/rllib site/ray/tune \
      site/ray/train site/ray/serve site/ray/llm site/ray/data)
    find "$tmp/site/ray/core" -type f -exec chmod +x {} +  # zipfile drops the exec bits of gcs_server and raylet
    tar -cf - -C "$tmp/site" . | xz -T0 -9e > "$out/ray.tar.xz"
  fi
else
  if [ ! -f "$out/router.tar.xz" ]; then
    dl "$tmp/whl" "${router[@]}"
    for w in "$tmp"/whl/*.whl; do python3 -m zipfile -e "$w" "$tmp/site"; done
    tar -cf - -C "$tmp/site" . | xz -T0 -9e > "$out/router.tar.xz"
  fi
fi

cat > "$out/install.sh" <<'INSTALL'
# Source from the repository root on the GPU host: installs this set into .offline-site/ (idempotent: an archive
# already unpacked there is skipped) and puts it and the repository on PYTHONPATH.
_dir=$(dirname "${BASH_SOURCE[0]}")
_site=$PWD/.offline-site
mkdir -p "$_site/.sets"
for _w in "$_dir"/*.whl; do
  [ -e "$_w" ] || continue
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$_site" "$_dir"/*.whl >/dev/null \
    || echo "install.sh: could not install the wheels of $_dir" >&2
  break
done
for _a in "$_dir"/*.tar.xz; do
  [ -e "$_a" ] || continue
  _stamp="$_site/.sets/$(basename "$_a").$(stat -c %s "$_a")"
  if [ ! -f "$_stamp" ]; then
    tar -xJf "$_a" -C "$_site" && touch "$_stamp" || echo "install.sh: could not unpack $_a" >&2
  fi
done
[ -d "$_site/ray/core" ] && find "$_site/ray/core" -type f ! -perm -u+x -exec chmod +x {} +
# the repository runs from PYTHONPATH here, uninstalled: its entry points (the simulator's plugins) need metadata
[ -f "$PWD/scripts/register_plugins.py" ] && python3 "$PWD/scripts/register_plugins.py" "$_site" >/dev/null
export PYTHONPATH=$_site:$PWD${PYTHONPATH:+:$PYTHONPATH}
export RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled
unset _dir _site _w _a _stamp
INSTALL
du -sh "$out"
