#!/usr/bin/env bash
# Engine fault tolerance, full length: 20 repetitions each of a SIGKILLed and of a hung engine during a
# 64-sample rollout (CI runs 5 of each via FT_REPS' default). Record the outcome in docs/performance.md.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
REPS=${FT_REPS:-20}
start=$(date +%s)
FT_REPS=$REPS "$PY" -m pytest tests/integration/test_fault_tolerance.py -q -p no:randomly -p no:cacheprovider "$@"
echo "fault_tolerance: ${REPS} repetitions per fault (kill, hang) passed in $(( $(date +%s) - start )) s"
