#!/usr/bin/env bash
# Offline installer of the SGLang pack (built by `bash scripts/pack_offline_deps.sh sglang`; docs/offline_gpu.md).
# From the repository root on the GPU host, after each chunk has arrived:
#   bash .offline-sglang/install.sh            # install the chunks that are here into $PWD/.sgl-site
#   bash .offline-sglang/install.sh --check    # ... then versions, toolchain, imports, GPU kernel self-tests
# Idempotent: a chunk cN/ is checksum-verified against its MANIFEST.sha256 and unpacked unless .sgl-site already
# records that manifest; chunks of another build (PACK_ID) start the site afresh. Nothing is downloaded.
# Writes .sgl-site/env.sh and the interpreter wrapper .sgl-site/bin/python (sources env.sh, execs the python3
# that ran this script): `--sglang-python .sgl-site/bin/python` gives only the server processes this site.
# Exit 1 only when something is broken (a bad checksum, c1 missing, a failed unpack or check); a later chunk
# that has not arrived yet is reported and is not an error.
# Knobs: SGLPACK_PYTHON (default python3), SGL_SITE (default $PWD/.sgl-site), SGLPACK_DIR (the chunks' folder).
set -u
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
pack=${SGLPACK_DIR:-$here}
# run as scripts/sglang_pack/install.sh: the chunks are in .offline-sglang/
[ -d "$pack/c1" ] || [ -n "${SGLPACK_DIR:-}" ] || [ ! -d "$PWD/.offline-sglang" ] || pack=$PWD/.offline-sglang
tpl=$pack/pack
[ -f "$tpl/env.sh.in" ] || tpl=$here
[ -f "$tpl/env.sh.in" ] || tpl=$PWD/scripts/sglang_pack
site=${SGL_SITE:-$PWD/.sgl-site}
py=$("${SGLPACK_PYTHON:-python3}" -c 'import sys; print(sys.executable)') || {
  echo "install.sh: no ${SGLPACK_PYTHON:-python3}" >&2
  exit 1
}
say() { echo "install.sh: $*"; }
rc=0
mkdir -p "$site/.sglpack" || exit 1

# --- chunks ------------------------------------------------------------------------------------------------
want_n=0
for dir in "$pack"/c[0-9]*/; do
  [ -d "$dir" ] || continue
  c=$(basename "$dir")
  if [ ! -f "$dir/MANIFEST.sha256" ]; then say "$c: no MANIFEST.sha256 (incomplete copy), not installed"; rc=1; continue; fi
  if ! (cd "$dir" && sha256sum --quiet --strict -c MANIFEST.sha256 > /dev/null 2>&1); then
    say "$c: checksum mismatch or file missing (truncated copy?), not installed"
    rc=1
    continue
  fi
  read -r id n < "$dir/PACK_ID"
  [ "${n:-0}" -gt "$want_n" ] && want_n=$n
  old_id=$(cat "$site/.sglpack/pack_id" 2> /dev/null || true)
  if [ -n "$old_id" ] && [ "$old_id" != "$id" ]; then
    say "$c: from pack $id, .sgl-site holds pack $old_id: starting .sgl-site afresh"
    find "$site" -mindepth 1 -maxdepth 1 -exec rm -rf {} + && mkdir -p "$site/.sglpack"
  fi
  echo "$id" > "$site/.sglpack/pack_id"
  stamp=$(sha256sum "$dir/MANIFEST.sha256" | cut -d' ' -f1)
  if [ "$(cat "$site/.sglpack/$c" 2> /dev/null)" = "$stamp" ]; then continue; fi
  ok=1
  for t in "$dir"/*.tar.xz; do
    tar -xJf "$t" -C "$site" || { say "$c: unpacking $(basename "$t") failed"; ok=0; }
  done
  if [ $ok = 1 ]; then echo "$stamp" > "$site/.sglpack/$c" && say "$c: installed"; else rc=1; fi
done
have="" missing=""
for ((i = 1; i <= (want_n > 0 ? want_n : 1); i++)); do
  if [ -f "$site/.sglpack/c$i" ]; then have="$have c$i"; else missing="$missing c$i"; fi
done
[ -f "$site/.sglpack/c1" ] || rc=1
say "pack $(cat "$site/.sglpack/pack_id" 2> /dev/null || echo none) in $site: installed${have:- nothing};" \
  "missing:${missing:- none}${missing:+ (copy them next to install.sh and run it again)}"

# --- CUDA toolkit for JIT builds: a root with bin/nvcc and include/cuda_runtime.h, seen through cuda-home/ -----
# tvm-ffi links `-L$CUDA_HOME/lib64 -lcudart` and flashinfer also `-lcuda`; a pip-installed toolkit has lib/
# and only versioned sonames, so .sgl-site/cuda-home holds bin/include/nvvm links to the real root and a lib64/
# with unversioned links to the libcudart.so.13 and libcuda.so.1 found on this host.
pysite=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
root=""
nv=$(command -v nvcc 2> /dev/null || true)
for d in "${CUDA_HOME:-}" ${nv:+"$(dirname "$(dirname "$(readlink -f "$nv")")")"} /usr/local/cuda /usr/local/cuda-13.0 \
  "$pysite/nvidia/cu13" "$pysite/nvidia/cuda_nvcc"; do
  if [ -n "$d" ] && [ -x "$d/bin/nvcc" ] && [ -e "$d/include/cuda_runtime.h" ]; then root=$(readlink -f "$d"); break; fi
done
ch=$site/cuda-home
rm -rf "$ch"
if [ -n "$root" ]; then
  mkdir -p "$ch/lib64"
  for sub in bin include nvvm; do [ -e "$root/$sub" ] && ln -s "$root/$sub" "$ch/$sub"; done
  for lib in "$root"/lib64/* "$root"/lib/*; do [ -e "$lib" ] && [ ! -e "$ch/lib64/${lib##*/}" ] && ln -s "$lib" "$ch/lib64/"; done
  find_lib() { # find_lib SONAME: the first file of that name in the toolkit, the pip nvidia packages, ldconfig
    local f
    for f in "$root/lib64/$1" "$root/lib/$1" "$pysite"/nvidia/cu13/lib/"$1" "$pysite"/nvidia/cuda_runtime/lib/"$1"; do
      [ -e "$f" ] && { echo "$f"; return; }
    done
    ldconfig -p 2> /dev/null | awk -v n="$1" '$1 == n {print $NF; exit}'
  }
  [ -e "$ch/lib64/libcudart.so" ] || { f=$(find_lib libcudart.so.13); [ -n "$f" ] && ln -sf "$f" "$ch/lib64/libcudart.so"; }
  [ -e "$ch/lib64/libcuda.so" ] || { f=$(find_lib libcuda.so.1); [ -n "$f" ] && ln -sf "$f" "$ch/lib64/libcuda.so"; }
fi

# --- env.sh and the wrapper ------------------------------------------------------------------------------------
if [ -f "$tpl/env.sh.in" ] && [ -f "$tpl/python.in" ]; then
  sed -e "s|@SITE@|$site|g" -e "s|@CUDA_HOME@|${root:+$ch}|g" -e "s|@PYSITE@|$pysite|g" -e "s|@PYBIN@|$(dirname "$py")|g" \
    "$tpl/env.sh.in" > "$site/env.sh"
  mkdir -p "$site/bin"
  sed -e "s|@SITE@|$site|g" -e "s|@PYTHON@|$py|g" "$tpl/python.in" > "$site/bin/python"
  chmod +x "$site/bin/python"
  cp "$tpl/check.py" "$site/.sglpack/check.py" 2> /dev/null || true
else
  say "templates env.sh.in / python.in not found (in $pack/pack or scripts/sglang_pack): no env.sh, no wrapper"
  rc=1
fi
[ -n "$root" ] || say "no CUDA toolkit (bin/nvcc + include/cuda_runtime.h) found: JIT kernels outside the prebuilt cache cannot build"
[ $rc = 0 ] && say "server: --sglang-python $site/bin/python   (or: $site/bin/python -m sglang.launch_server ...)"

if [ "${1:-}" = "--check" ]; then
  if [ -f "$site/.sglpack/c1" ] && [ -x "$site/bin/python" ]; then
    nvcc_at=MISSING
    [ -n "$root" ] && nvcc_at=$root/bin/nvcc
    echo "--- toolchain: python=$py nvcc=$nvcc_at CUDA_HOME=${root:+$ch}" \
      "c++=$(command -v c++ || command -v g++ || echo MISSING) ninja=$(PATH=$(dirname "$py"):$PATH command -v ninja || echo MISSING)"
    for f in "$ch/lib64/libcudart.so" "$ch/lib64/libcuda.so"; do [ -e "$f" ] || echo "--- WARNING: $f missing (JIT links need it)"; done
    timeout "${SGLPACK_CHECK_TIMEOUT:-300}" "$site/bin/python" "$site/.sglpack/check.py" || rc=1
  else
    say "--check: c1 is not installed"
    rc=1
  fi
fi
exit $rc
