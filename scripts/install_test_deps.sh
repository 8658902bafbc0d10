#!/usr/bin/env bash
# What the test suite needs beyond .venv (docs/testing.md): redis-server (agent gateway's shared store), the
# pinned agent CLIs (Claude Code, Codex) and the SGLang side venv (flag snapshot and argv checks). Idempotent.
#   bash scripts/install_test_deps.sh           install what is missing; a part that cannot be installed here
#                                               prints a one-line reason and the rest goes on (exit 0)
#   STRICT=1 bash scripts/install_test_deps.sh  any missing part is an error (CI)
# examples/toy/run_toy.sh runs this in the background (niced) while the quick start trains; a test session
# started meanwhile waits for it (conftest.py reads .test-deps.pid).
set -uo pipefail
cd "$(dirname "$0")/.."
STRICT=${STRICT:-0}
failed=0
t0=$(date +%s)
step() { echo "=== [test deps +$(( $(date +%s) - t0 ))s] $*"; }
missing() {  # $1 = what, $2 = one-line reason
  echo "test deps: $1 not installed: $2" >&2
  failed=1
}

step "redis-server"
if ! command -v redis-server >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null) \
      || missing redis-server "apt-get install redis-server failed"
  elif command -v sudo >/dev/null && sudo -n true 2>/dev/null && command -v apt-get >/dev/null; then
    (sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null) \
      || missing redis-server "sudo apt-get install redis-server failed"
  else
    missing redis-server "needs root for the system package (apt-get install redis-server, brew install redis)"
  fi
fi

step "agent CLIs (Claude Code, Codex; pinned, project-local)"
if command -v npm >/dev/null; then
  bash ci/agent_clis.sh || missing "agent CLIs" "npm install failed (see above)"
else
  missing "agent CLIs" "npm not found (install Node 20, then re-run scripts/install_test_deps.sh)"
fi

step "SGLang side venv"
bash ci/sglang_venv.sh .venv-sglang || missing "SGLang side venv" "ci/sglang_venv.sh failed (see above)"

step "done"
if [ "$failed" = 1 ] && [ "$STRICT" = 1 ]; then
  exit 1
fi
exit 0
