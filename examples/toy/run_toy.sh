#!/usr/bin/env bash
# Quick start: install .venv if missing, then train the toy task from a random-init model to a held-out eval
# reward of 0.9 (SFT warm-up, then GRPO through Ray, the real sglang-router and fake `hf` engines), print the
# eval curve and write $OUT/learning.png. `--smoke` runs 3 GRPO rollouts instead (the wiring check).
# Other flags go to examples/toy/quickstart.py; after `--`, to `slime train`.
# While it trains, what the test suite needs beyond .venv (scripts/install_test_deps.sh) installs in the
# background at low priority; its log is runs/install-test-deps.log.
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -x .venv/bin/slime ] || bash scripts/install.sh
if [ -z "${SLIME_SKIP_TEST_DEPS:-}" ] && ! { [ -f .test-deps.pid ] && kill -0 "$(cat .test-deps.pid)" 2>/dev/null; }; then
  mkdir -p runs
  nohup nice -n 19 bash -c 'bash scripts/install_test_deps.sh; rm -f .test-deps.pid' \
    > runs/install-test-deps.log 2>&1 < /dev/null &
  echo $! > .test-deps.pid
fi
OUT=${OUT:-runs/toy}
exec .venv/bin/python -m examples.toy.quickstart --out "$OUT" "$@"
