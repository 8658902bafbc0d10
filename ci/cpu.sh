#!/usr/bin/env bash
# Set-up for the CPU suite (docs/testing.md): system packages, .venv, agent CLIs, SGLang side venv, lint.
# .ci/run calls this, then runs the README's test command and the slow tests.
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$(date +%s)
step() { echo "=== [$(( $(date +%s) - t0 ))s] $*"; }

step "system packages (redis-server)"
if ! command -v redis-server >/dev/null; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null) \
    || { echo "error: redis-server could not be installed" >&2; exit 1; }
fi

step "python environment"
bash scripts/install.sh

step "agent CLIs (Claude Code, Codex; pinned, project-local)"
bash ci/agent_clis.sh

step "SGLang side venv (flag snapshot and argv checks)"
bash ci/sglang_venv.sh .venv-sglang

step "lint"
.venv/bin/ruff check .
.venv/bin/ruff format --check .

step "setup done (tests run from .ci/run)"
