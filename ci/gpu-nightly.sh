#!/usr/bin/env bash
# The GPU nightly: every GPU test, then the GPU benches, on one GPU host; a JSON and a markdown summary at the end.
#
#   bash ci/gpu-nightly.sh [OUT_DIR]          (default runs/gpu-nightly/<date>; on the lent device: $OUT)
#
# Installing what it needs, from the repository root, once per host:
#   online:   python -m pip install -e . pytest hypothesis   (megatron-core, torch-memory-saver, Ray and
#             sglang-router are slime's own pinned dependencies, pyproject.toml)
#   offline:  on a machine with network, `bash scripts/pack_offline_deps.sh core` and `... router`; copy the two
#             directories (.offline-core, .offline-router) to the host; the script sources their install.sh
#             when it finds them (they install into .offline-site/ and put it and the repository on PYTHONPATH).
#             A site directory installed earlier is picked up by setting SLIME_GPU_SITE=DIR instead.
# Parts (each one's log under OUT_DIR; a failing part is recorded and the next one still runs):
#   tests       pytest -m gpu over tests/ (the GPU unit tests and tests/gpu; two-GPU tests skip on one GPU)
#   sync        python -m bench.gpu_weight_sync  (colocated weight sync vs the bare CUDA-IPC hand-off)
#   offload     python -m bench.gpu_offload      (sleep / wake-up vs pinned PCIe, GPU memory while asleep)
#   train       python -m bench.gpu_train        (train-step MFU, two shapes, 1 and 4 samples of 4096 per micro-batch)
#   sglang      bash ci/gpu_sglang.sh check conformance direct step serving: real SGLang (its offline pack,
#               .offline-sglang, or SLIME_SGLANG_PYTHON naming an interpreter that imports SGLang); the real-SGLang
#               GPU tests run in `tests` (tests/gpu/test_real_sglang.py skips without SGLang)
# NIGHTLY_PARTS="tests sync" runs a subset; NIGHTLY_MODEL (default 1.8B) picks the benches' model shape.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/gpu-nightly/$(date +%Y%m%d-%H%M)}
mkdir -p "$out"
parts=${NIGHTLY_PARTS:-"tests sync offload train sglang"}
model=${NIGHTLY_MODEL:-1.8B}

if [ -n "${SLIME_GPU_SITE:-}" ]; then
  export PYTHONPATH="$SLIME_GPU_SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
  python3 scripts/register_plugins.py "$SLIME_GPU_SITE" >/dev/null  # the simulator's entry points, uninstalled
else
  [ -f .offline-sglang/install.sh ] && bash .offline-sglang/install.sh  # SGLang's own site, for its servers only
  for pack in .offline-core .offline-router; do
    # shellcheck disable=SC1091
    [ -f "$pack/install.sh" ] && source "$pack/install.sh"
  done
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA GPU'; print('GPU:', torch.cuda.get_device_name())" \
  || { echo "gpu-nightly: this host has no usable CUDA GPU"; exit 2; }

work=$(mktemp -d /tmp/slime-gpu-bench.XXXX)  # the benches' checkpoint, built once for all of them
declare -A rc
run_part() {  # name, command...
  local name=$1; shift
  echo "== $name: $*"
  local t0=$SECONDS
  "$@" >"$out/$name.log" 2>&1
  rc[$name]=$?
  echo "== $name: exit ${rc[$name]} after $((SECONDS - t0)) s (log $out/$name.log)"
  tail -n 25 "$out/$name.log"
}
for part in $parts; do
  case $part in
    tests) run_part tests python -m pytest -m gpu tests -o addopts="" -p no:cacheprovider -q \
             --junitxml "$out/tests.xml" ;;
    sync) run_part sync python -m bench.gpu_weight_sync --model "$model" --work "$work" --out "$out/gpu_weight_sync.json" ;;
    offload) run_part offload python -m bench.gpu_offload --model "$model" --work "$work" --out "$out/gpu_offload.json" ;;
    train) run_part train python -m bench.gpu_train --model 1.8B 0.5B --adam fused --micro-batches 4 \
        --seq 4096 16384 --sample-len 4096 --loss logprob --out "$out/gpu_train.json" ;;
    sglang) run_part sglang env OUT="$out/sglang" bash ci/gpu_sglang.sh check conformance direct step serving ;;
    *) echo "gpu-nightly: unknown part '$part' (tests sync offload train sglang)"; exit 2 ;;
  esac
done
rm -rf "$work"
codes=""
for part in $parts; do codes="$codes $part=${rc[$part]}"; done
python ci/gpu_nightly_summary.py "$out" $codes
status=0
for part in $parts; do [ "${rc[$part]}" = 0 ] || status=1; done
exit $status
