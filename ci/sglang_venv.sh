#!/usr/bin/env bash
# Side venv with SGLang 0.5.23's Python package, used only to read its server CLI (ServerArgs.add_cli_args):
# the flag snapshot generator and the tests that parse the argv slime builds run here. SGLang's own pins
# (torch 2.14.1 CUDA, transformers 5.19) clash with the main env, so it lives apart (docs/testing.md).
#
#   bash ci/sglang_venv.sh [VENV_DIR=.venv-sglang]
#
# Idempotent: a stamp file records a hash of this script and of ci/triton_stub; when it matches, the
# script only re-checks the import (a few seconds). Delete the venv or edit the pins to rebuild.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv-sglang}"
PY="${PYTHON:-python3}"
t0=$(date +%s)
say() { echo "[sglang_venv +$(( $(date +%s) - t0 ))s] $*"; }

# Exact pins. sglang goes in with --no-deps: these are only the modules importing `sglang.srt.server_args`
# needs (check_import below proves it), not its 4 GB runtime. triton is replaced by ci/triton_stub.
TORCH_PIN="torch==2.13.0"                 # the CPU wheel pip finds on local disk
SGLANG_PIN="sglang==0.5.23"
DEPS=(
  "transformers==5.24.0"
  "orjson==3.13.0" "psutil==7.2.2" "pybase64==1.5.1" "pillow==13.0.0" "starlette==1.10.0"
  "msgspec==0.22.0" "pyzmq==27.3.0" "ipython==9.18.1" "aiohttp==3.14.5" "requests==2.34.2"
)

stamp_of() {
  { cat "$0"; cat ci/triton_stub/pyproject.toml ci/triton_stub/triton/__init__.py; } \
    | sha256sum | cut -d' ' -f1
}
STAMP="$VENV/.slime-sglang-venv.stamp"
want=$(stamp_of)

check_import() {
  "$VENV/bin/python" - <<'PY'
import argparse, importlib.metadata as md
from sglang.srt.server_args import ServerArgs
p = argparse.ArgumentParser()
ServerArgs.add_cli_args(p)
assert md.version("sglang") == "0.5.23", md.version("sglang")
print(f"sglang {md.version('sglang')}: {len(p._actions)} CLI actions; torch {md.version('torch')}; triton {md.version('triton')}")
PY
}

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" && -x "$VENV/bin/python" ]]; then
  say "stamp matches, $VENV is complete; checking the import"
  check_import
  say "done"
  exit 0
fi

say "building $VENV with $($PY --version 2>&1)"
rm -f "$STAMP"
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
"${PIP[@]}" -U "pip==26.3"
say "pip ready"
"${PIP[@]}" "$TORCH_PIN" "${DEPS[@]}"
say "torch + import deps installed"
"${PIP[@]}" --no-deps "$SGLANG_PIN"
say "sglang installed (--no-deps)"
# Build from a copy: setuptools leaves build/ and *.egg-info next to the sources otherwise.
stub_src=$(mktemp -d)
trap 'rm -rf "$stub_src"' EXIT
cp ci/triton_stub/pyproject.toml "$stub_src/" && cp -r ci/triton_stub/triton "$stub_src/"
"${PIP[@]}" --no-deps --force-reinstall "$stub_src"
say "triton stub installed"
check_import
echo "$want" > "$STAMP"
say "done: $(du -sh "$VENV" | cut -f1) in $VENV"
