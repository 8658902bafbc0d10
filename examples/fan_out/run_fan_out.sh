#!/usr/bin/env bash
# Fan-out example: the toy task, but every trajectory is generated in 1-4 segments (simulated context
# compaction) and trained as one group of 1-4 samples. Extra flags are passed to `slime train`.
# Metrics: $OUT/metrics.jsonl (train/samples varies per step, train/global_batch_size stays constant).
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -x .venv/bin/slime ] || bash scripts/install.sh
OUT=${OUT:-runs/fan_out}
.venv/bin/python -m examples.toy.prepare --out "$OUT/assets"
exec .venv/bin/slime train \
  --hf-checkpoint "$OUT/assets/model" \
  --prompt-data "$OUT/assets/data/train.jsonl" \
  --input-key input --label-key label --apply-chat-template \
  --custom-rm-path examples.toy.reward.reverse_digits_rm \
  --custom-generate-function-path examples.fan_out.generate.generate \
  --rollout-batch-size 4 --n-samples-per-prompt 4 --num-rollout 4 \
  --rollout-max-response-len 12 --rollout-temperature 1.0 --rollout-shuffle \
  --actor-num-nodes 1 --actor-num-gpus-per-node 1 \
  --rollout-num-gpus 1 --rollout-num-gpus-per-engine 1 \
  --rollout-engine sim --sim-engine hf \
  --custom-megatron-init-path sim.fake_megatron.cpu_shim.apply \
  --use-dynamic-batch-size --max-tokens-per-gpu 512 \
  --global-batch-size 16 --lr 1e-4 \
  --metrics-dir "$OUT" \
  --save-debug-rollout-data "$OUT/dump/rollout_{rollout_id}.pt" \
  "$@"
