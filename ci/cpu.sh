#!/usr/bin/env bash
# Set-up for the CPU suite (docs/testing.md): .venv, then what the tests need beyond it (redis-server, agent
# CLIs, SGLang side venv; strict here: CI runs with 0 skipped), then lint. .ci/run calls this, then runs the
# README's test command and the slow tests.
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$(date +%s)
step() { echo "=== [$(( $(date +%s) - t0 ))s] $*"; }

step "python environment"
bash scripts/install.sh

step "test dependencies"
STRICT=1 bash scripts/install_test_deps.sh

step "lint"
.venv/bin/ruff check .
.venv/bin/ruff format --check .

step "setup done (tests run from .ci/run)"
