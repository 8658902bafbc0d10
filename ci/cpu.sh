#!/usr/bin/env bash
# The CPU suite (design.md §6): install, lint, the README's test command, then the slow tests.
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

# pytest exit code 5 = no tests collected: treat as a failure, a suite that runs nothing proves nothing.
step "tests: cpu and not slow (the README's command)"
source .venv/bin/activate
pytest -m "cpu and not slow" -n 2

step "tests: cpu and slow"
pytest -m "cpu and slow" -n 2

step "done"
