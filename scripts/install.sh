#!/usr/bin/env bash
# Create .venv with slime, sim and the test tools (pins in pyproject.toml). Idempotent; safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q -U pip
fi
# torch==2.13.0 is pinned first so no other requirement can pull a multi-GB CUDA build.
"$VENV/bin/python" -m pip install -q torch==2.13.0
"$VENV/bin/python" -m pip install -q -e '.[test]'
echo "installed into $VENV ($("$VENV/bin/python" -c 'import torch, ray, megatron.core, transformers; print("torch", torch.__version__, "ray", ray.__version__, "transformers", transformers.__version__)'))"
