#!/usr/bin/env bash
# Quick start: install (if needed), build the tiny model + reverse-digits task locally, run 3 rollouts through
# Ray, the real sglang-router and 2 fake `hf` engines. Extra flags are passed to `slime train`.
# Metrics: $OUT/metrics.jsonl and TensorBoard events in $OUT/tb.
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -x .venv/bin/slime ] || bash scripts/install.sh
OUT=${OUT:-runs/toy}
.venv/bin/python -m examples.toy.prepare --out "$OUT/assets"
exec .venv/bin/slime train \
  --hf-checkpoint "$OUT/assets/model" \
  --prompt-data "$OUT/assets/data/train.jsonl" \
  --input-key input --label-key label --apply-chat-template \
  --custom-rm-path examples.toy.reward.reverse_digits_rm \
  --rollout-batch-size 8 --n-samples-per-prompt 4 --num-rollout 3 \
  --rollout-max-response-len 12 --rollout-temperature 1.0 --rollout-shuffle \
  --actor-num-nodes 1 --actor-num-gpus-per-node 1 \
  --rollout-num-gpus 2 --rollout-num-gpus-per-engine 1 \
  --rollout-engine sim --sim-engine hf \
  --custom-megatron-init-path sim.fake_megatron.cpu_shim.apply \
  --global-batch-size 32 \
  --metrics-dir "$OUT" \
  --save-debug-rollout-data "$OUT/dump/rollout_{rollout_id}.pt" \
  "$@"
