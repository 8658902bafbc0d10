#!/usr/bin/env bash
# Set-up for the CPU suite (docs/testing.md): .venv, then what the tests need beyond it (redis-server, agent
# CLIs, SGLang side venv; strict here: CI runs with 0 skipped), then lint. .ci/run calls this, then runs the
# README's test command and the slow tests.
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$(date +%s)
step() { echo "=== [$(( $(date +%s) - t0 ))s] $*"; }

# The two installs share nothing (.venv; redis, npm CLIs, .venv-sglang) and mostly wait on downloads and
# unpacking: side by side they take about the longer one's time. The test deps' output is shown when they end.
step "python environment, and test dependencies alongside (log: .test-deps.log)"
STRICT=1 bash scripts/install_test_deps.sh > .test-deps.log 2>&1 &
deps=$!
bash scripts/install.sh

step "test dependencies"
deps_rc=0
wait "$deps" || deps_rc=$?
cat .test-deps.log
if [ "$deps_rc" != 0 ]; then
  echo "test dependencies failed (exit $deps_rc)" >&2
  exit "$deps_rc"
fi

step "bytecode of the repository's packages (every test's child processes import them)"
.venv/bin/python -m compileall -q -j 0 slime sim examples bench tests >/dev/null

step "lint"
.venv/bin/ruff check .
.venv/bin/ruff format --check .

step "setup done (tests run from .ci/run)"
