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
# Usage: bash scripts/pack_offline_deps.sh [core|router] [OUTDIR] [--python-version 3.12]
set -euo pipefail
set_name=core
case "${1:-}" in core | router) set_name=$1; shift ;; esac
out=${1:-.offline-$set_name}
[ $# -gt 0 ] && shift
pyver=3.12
if [ "${1:-}" = "--python-version" ]; then pyver=$2; shift 2; fi
mkdir -p "$out"

# versions as pinned in pyproject.toml
core=(megatron-core==0.16.1 torch-memory-saver==0.0.10 ray==2.60.0 jsonschema referencing rpds-py
      jsonschema-specifications)
router=(sglang-router==0.3.2 setproctitle orjson uvicorn fastapi starlette pydantic pydantic-core annotated-types
        typing-inspection typing-extensions opentelemetry-api importlib-metadata redis)
if [ "$set_name" = core ]; then pkgs=("${core[@]}"); else pkgs=("${router[@]}"); fi

# binary wheels for the host's interpreter and any manylinux x86_64 tag, without dependencies (the host has them)
python3 -m pip download -q --no-deps --only-binary=:all: --implementation cp --python-version "$pyver" \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$out" "${pkgs[@]}"

cat > "$out/install.sh" <<'EOF'
# Source from the repository root on the GPU host: installs this directory's wheels into .offline-site/.
_dir=$(dirname "${BASH_SOURCE[0]}")
_site=$PWD/.offline-site
mkdir -p "$_site"
python3 -m pip install -q --no-index --no-deps --target "$_site" "$_dir"/*.whl \
  || echo "install.sh: could not install the wheels of $_dir" >&2
export PYTHONPATH=$_site:$PWD${PYTHONPATH:+:$PYTHONPATH}
export RAY_USAGE_STATS_ENABLED=0
EOF
du -sh "$out"
