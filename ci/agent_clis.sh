#!/usr/bin/env bash
# Installs the pinned agent CLIs the gateway is tested against (docs/testing.md) into a project-local prefix.
#   @anthropic-ai/claude-code@2.1.197 (native binary, package claude-code-linux-x64)
#   @openai/codex@0.171.0             (musl binary, package codex-linux-x64)
# Idempotent: an existing install at the pinned versions is kept. Prints the versions.
# Usage: ci/agent_clis.sh [PREFIX]   (default: <repo>/.agent-clis, or $SLIME_AGENT_CLIS_PREFIX)
# The tests find the binaries through the same prefix (slime/agent/harness/cli.py).
set -euo pipefail
cd "$(dirname "$0")/.."
PREFIX="${1:-${SLIME_AGENT_CLIS_PREFIX:-$PWD/.agent-clis}}"
CLAUDE_VERSION=2.1.197
CODEX_VERSION=0.171.0

installed_version() {  # $1 = package name
  local pj="$PREFIX/node_modules/$1/package.json"
  [ -f "$pj" ] && node -p "require('$pj').version" 2>/dev/null || true
}

if ! command -v npm >/dev/null; then
  echo "error: npm not found (Node 20 is expected on the image)" >&2
  exit 1
fi
mkdir -p "$PREFIX"
if [ "$(installed_version @anthropic-ai/claude-code)" != "$CLAUDE_VERSION" ] \
  || [ "$(installed_version @openai/codex)" != "$CODEX_VERSION" ]; then
  # --include=optional: the platform binaries ship as optional dependencies of the wrapper packages
  npm install --prefix "$PREFIX" --no-audit --no-fund --no-save --include=optional \
    "@anthropic-ai/claude-code@$CLAUDE_VERSION" "@openai/codex@$CODEX_VERSION"
fi

# the native binaries come from the platform packages (optional dependencies of the wrappers)
CLAUDE_BIN=$(ls "$PREFIX"/node_modules/@anthropic-ai/claude-code-linux-*/claude 2>/dev/null | head -1)
CODEX_BIN=$(ls "$PREFIX"/node_modules/@openai/codex-linux-*/vendor/*-unknown-linux-musl/bin/codex 2>/dev/null | head -1)
for b in "$CLAUDE_BIN" "$CODEX_BIN"; do
  if [ -z "$b" ] || [ ! -x "$b" ]; then
    echo "error: a CLI binary is missing under $PREFIX/node_modules after install" >&2
    exit 1
  fi
done
echo "claude-code: $("$CLAUDE_BIN" --version 2>/dev/null | head -1) ($CLAUDE_BIN)"
echo "codex: $("$CODEX_BIN" --version 2>/dev/null | head -1) ($CODEX_BIN)"
