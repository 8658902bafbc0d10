#!/usr/bin/env bash
# Builds the offline SGLang pack. Called as `bash scripts/pack_offline_deps.sh sglang [OUTDIR]`, which holds the
# package pins and says what is left out and why; this file does the mechanics:
#   1. download the pinned wheels (cp312 / abi3 / py3, x86_64, --no-deps) into BUILD/wheels (a cache);
#   2. unpack them into BUILD/site, remove the parts the serving path never loads, patch sgl_kernel's norm;
#   3. optionally prebuild sglang's tvm-ffi JIT kernels for sm90 into BUILD/site/jit-cache (prebuild_jit.py);
#   4. write the chunks OUTDIR/cN/{site-N.tar.xz,PACK_ID,MANIFEST.sha256} (each <= 60 MB), OUTDIR/install.sh
#      and OUTDIR/pack/ (the env template, the interpreter wrapper, the --check self-test).
# BUILD is ${SGLPACK_BUILD:-OUTDIR.build} (git-ignored, not shipped). Knobs: SGLPACK_JIT_PYTHON (a CPython 3.12
# with torch 2.11, for step 3; unset: skipped unless .venv-sglang/bin/python exists), SGLPACK_XZ_THREADS.
# Usage: bash scripts/sglang_pack/build.sh OUTDIR PKG==VER...
set -euo pipefail
out=$1
shift
tpl=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
build=${SGLPACK_BUILD:-$out.build}
mkdir -p "$out" "$build"
out=$(cd "$out" && pwd) build=$(cd "$build" && pwd)
wheels=$build/wheels
site=$build/site
limit=60000000 # bytes per chunk: a device call carries 64 MiB in all, the repository's tree included
mkdir -p "$wheels" "$out"
say() { echo "pack sglang: $*"; }

plat=(--only-binary=:all: --implementation cp --python-version 3.12 --abi cp312 --abi abi3 --abi none
  --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
  --platform linux_x86_64 --platform any)

# 1. the wheels named by the pins (the cache may hold older ones: only the pinned files are used)
say "downloading ${#} pinned wheels into $wheels"
python3 -m pip download -q --no-deps "${plat[@]}" -d "$wheels" "$@" 2>&1 | { grep -v 'is ignored' >&2 || true; }
[ "${PIPESTATUS[0]}" = 0 ] || { say "pip download failed" >&2; exit 1; }
files=()
for spec in "$@"; do
  name=${spec%%==*} ver=${spec##*==}
  norm=$(echo "$name" | tr 'A-Z.-' 'a-z__')
  f=$(find -H "$wheels" -maxdepth 1 -iname "${norm}-${ver}-*.whl" | sort | head -n1)
  [ -n "$f" ] || { say "no wheel for $spec in $wheels" >&2; exit 1; }
  files+=("$f")
done

# 2. stage and strip
rm -rf "$site"
mkdir -p "$site"
say "unpacking into $site"
python3 -m pip install -q --no-deps --no-compile --target "$site" "${plat[@]}" "${files[@]}" 2>&1 \
  | { grep -v -e 'Running pip as the' -e 'is ignored' >&2 || true; }
[ -d "$site/sglang" ] || { say "unpacking failed" >&2; exit 1; }
removed=(
  sgl_kernel/flash_ops.abi3.so sgl_kernel/sm100 sgl_kernel/flashmla_ops.abi3.so xgrammar/lib/libxgrammar.a
  # stray top-level files that could shadow the repository's modules, scripts and man pages
  tools build_backend.py build_utils.py bin share
)
for p in "${removed[@]}"; do rm -rf "${site:?}/$p"; done
find "$site" -name __pycache__ -prune -exec rm -rf {} +
while IFS= read -r so; do
  if file -b "$so" | grep -q 'with debug_info'; then strip --strip-debug "$so"; fi
done < <(find "$site" -name '*.so' -size +1M)
python3 "$tpl/patch_sgl_kernel.py" "$site/sgl_kernel/elementwise.py"
{
  echo "offline SGLang pack (scripts/pack_offline_deps.sh sglang), built $(date -u +%Y-%m-%dT%H:%MZ)"
  echo "wheels (--no-deps):"
  printf '  %s\n' "$@"
  echo "removed from the wheels: ${removed[*]}"
  echo "debug info stripped: every .so > 1 MB that had it (libxgrammar_bindings.so, zstandard, ...)"
  echo "patched: sgl_kernel/elementwise.py (rmsnorm/fused_add_rmsnorm on common_ops; SGLPACK_FLASHINFER_NORM=1: upstream)"
} > "$site/SGLPACK-INFO.txt"

# 3. the JIT cache (optional): sglang's tvm-ffi kernels of the dense Qwen2/Llama path, built for sm90 here
jitpy=${SGLPACK_JIT_PYTHON:-}
[ -z "$jitpy" ] && [ -x .venv-sglang/bin/python ] && jitpy=.venv-sglang/bin/python
if [ -n "$jitpy" ] && command -v nvcc > /dev/null; then
  say "prebuilding the sm90 JIT cache with $jitpy"
  rm -rf "$build/jit-cache"
  if PYTHONPATH=$site TVM_FFI_CACHE_DIR=$build/jit-cache/tvm-ffi "$jitpy" "$tpl/prebuild_jit.py"; then
    mkdir -p "$site/jit-cache/tvm-ffi"
    # only the built modules: a cache hit is `<dir>/<module>.so`, the ninja files and objects are not needed
    (cd "$build/jit-cache/tvm-ffi" && find . -name '*.so' -exec cp --parents {} "$site/jit-cache/tvm-ffi/" \;)
    echo "jit-cache/tvm-ffi: $(find "$site/jit-cache/tvm-ffi" -name '*.so' | wc -l) modules for sm90 (TVM_FFI_CACHE_DIR)" \
      >> "$site/SGLPACK-INFO.txt"
  else
    say "JIT prebuild failed: the pack goes without a JIT cache (kernels compile on the GPU at first use)" >&2
  fi
else
  say "no SGLPACK_JIT_PYTHON (a CPython 3.12 with torch 2.11) or no nvcc: no prebuilt JIT cache"
fi

# 4. chunks: c1 = what the server needs to start; c2 = the JIT cache and lazily loaded extras
later=(jit-cache sgl_kernel/infllm_ops.cpython-310-x86_64-linux-gnu.so)
rm -rf "$out"/c[0-9]*
mkchunk() { # mkchunk N tar-args...
  local n=$1 dir=$out/c$1
  shift
  mkdir -p "$dir"
  say "writing $dir/site-$n.tar.xz"
  tar -C "$site" --sort=name --owner=0 --group=0 --numeric-owner --mtime=2026-01-01 -cf - "$@" \
    | xz -9 -T"${SGLPACK_XZ_THREADS:-0}" > "$dir/site-$n.tar.xz"
}
excl=()
for p in "${later[@]}"; do excl+=(--exclude="./$p"); done
mkchunk 1 "${excl[@]}" .
have=()
for p in "${later[@]}"; do [ -e "$site/$p" ] && have+=("./$p"); done
[ ${#have[@]} -gt 0 ] && mkchunk 2 "${have[@]}"
pack_id=$(sha256sum "$out/c1/site-1.tar.xz" | cut -c1-16)
nchunks=$(find "$out" -maxdepth 1 -name 'c[0-9]*' -type d | wc -l)
rc=0
for dir in "$out"/c[0-9]*; do
  echo "$pack_id $nchunks" > "$dir/PACK_ID" # install.sh: which build, and how many chunks it has
  (cd "$dir" && sha256sum -- *.tar.xz PACK_ID > MANIFEST.sha256)
  size=$(du -cb "$dir" | tail -n1 | cut -f1)
  say "$(basename "$dir"): $size bytes"
  if [ "$size" -gt "$limit" ]; then say "$(basename "$dir") is over $limit bytes" >&2; rc=1; fi
done

# templates: install.sh beside the chunks, the rest in pack/
cp "$tpl/install.sh" "$out/install.sh"
mkdir -p "$out/pack"
cp "$tpl/env.sh.in" "$tpl/python.in" "$tpl/check.py" "$out/pack/"
say "pack $pack_id in $out ($(du -sb "$out" | cut -f1) bytes); on the host: bash $out/install.sh --check"
exit $rc
