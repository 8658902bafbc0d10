#!/usr/bin/env bash
# The coding-agent example on CPU: scripted policy, real agent CLI in local sandboxes, 2 rollouts x 8 episodes,
# GRPO on the tiny checkpoint with the CPU megatron shim. HARNESS=codex for Codex. Needs ci/agent_clis.sh.
set -euo pipefail
cd "$(dirname "$0")/../.."
HARNESS="${HARNESS:-claude-code}"
OUT="${OUT:-/tmp/slime-coding-agent}"
PY="${PY:-.venv/bin/python}"
mkdir -p "$OUT"
"$PY" -c "from sim.tiny_checkpoint import build_tiny_checkpoint as b; b('$OUT/tiny', max_position_embeddings=65536)"
"$PY" -m examples.coding_agent.scripted_policy --harness "$HARNESS" --out "$OUT/script.json"
PYTHONPATH="$PWD" "$PY" -m slime.cli train \
  --hf-checkpoint "$OUT/tiny" --prompt-data examples/coding_agent/tasks.jsonl --input-key input \
  --custom-generate-function-path slime.agent.harness.repo_task.generate --agent-harness "$HARNESS" \
  --agent-codex-sandbox bypass --agent-sandbox local --agent-timeout 120 --agent-eval-timeout 60 \
  --rollout-batch-size 4 --n-samples-per-prompt 2 --num-rollout 2 --global-batch-size 8 \
  --rollout-max-response-len 512 --rollout-max-context-len 32768 --rollout-temperature 1.0 \
  --actor-num-nodes 1 --actor-num-gpus-per-node 1 --rollout-num-gpus 1 \
  --rollout-engine sim --sim-engine scripted --sim-script "$OUT/script.json" \
  --custom-megatron-init-path sim.fake_megatron.cpu_shim.apply --lr 1e-3 --entropy-coef 0.01 \
  --save-debug-rollout-data "$OUT/dump/{rollout_id}.pt" --metrics-dir "$OUT/run"
