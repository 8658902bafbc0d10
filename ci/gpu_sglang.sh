#!/usr/bin/env bash
# Real SGLang on a GPU host, phase by phase: the `sglang` part of ci/gpu-nightly.sh (docs/offline_gpu.md).
#
#   bash ci/gpu_sglang.sh PHASE [PHASE ...]
#     check        the SGLang pack's self-test (imports, three GPU kernels)
#     conformance  SGLang on the tiny toy model: the recorder's fixtures (fixtures.tgz) and the server flags as its
#                  own parser prints them (sglang_flags_live.json)
#     direct       generation throughput of SGLang alone on the ~1.2B shape (bench.gpu_sglang_serving --ways sglang)
#     tests        pytest -m gpu tests/gpu/test_real_sglang.py
#     step         the colocated ~1.2B GRPO step with SGLang, phase by phase, and its sync against the bare
#                  CUDA-IPC hand-off (bench.gpu_real_sglang_step)
#     serving      the other rows of the throughput table: through slime's router, --debug-rollout-only, fake hf
#
# First installs whatever packs arrived (.offline-sglang, .offline-core, .offline-router: scripts/
# pack_offline_deps.sh; each idempotent). Results go to $OUT (default runs/gpu-sglang): this script's log, JSON
# and a tarball of the servers' and runs' logs. Every phase is bounded in time; a failed phase is reported and the
# next one runs; exit 1 if any failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu-sglang}
WORK=${WORK:-/tmp/slime-gpu-sglang}
mkdir -p "$OUT" "$WORK/logs"
exec > >(tee -a "$OUT/gpu_sglang.log") 2>&1
PY=python3
SGL=${SLIME_SGLANG_PYTHON:-$PWD/.sgl-site/bin/python}  # the interpreter that runs SGLang servers
PORT=${SGLANG_PORT:-30000}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 SLIME_SGLANG_PYTHON=$SGL PY SGL PORT WORK OUT
rc=0
t0=$(date +%s)
say() { echo "=== [+$(( $(date +%s) - t0 ))s $(date +%T)] $*"; }

say "install"
[ -f .offline-sglang/install.sh ] && bash .offline-sglang/install.sh
# shellcheck disable=SC1091
[ -f .offline-core/install.sh ] && source .offline-core/install.sh
# shellcheck disable=SC1091
[ -f .offline-router/install.sh ] && source .offline-router/install.sh
export PYTHONPATH=${PYTHONPATH:-$PWD}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader 2>/dev/null

phase() {  # NAME SECONDS COMMAND...: the command's output to $WORK/logs/NAME.log, its tail here
  local name=$1 limit=$2
  shift 2
  say "$name (at most ${limit}s)"
  timeout --kill-after=30 "$limit" "$@" > "$WORK/logs/$name.log" 2>&1
  local r=$?
  tail -n "${TAIL:-30}" "$WORK/logs/$name.log"
  say "$name: exit $r"
  [ "$r" = 0 ] || rc=1
}

wait_health() {  # URL SECONDS
  local deadline=$(( $(date +%s) + $2 ))
  until curl -sf "$1/health_generate" >/dev/null 2>&1; do
    [ "$(date +%s)" -gt "$deadline" ] && return 1
    sleep 2
  done
}

conformance() {
  $PY -m examples.toy.prepare --out "$WORK/toy64" --num-train 4 --num-eval 2 --hidden-size 256 --num-heads 4 \
    --num-kv-heads 2 --intermediate-size 512 || return 1
  local argv=(-m sglang.launch_server --model-path "$WORK/toy64/model" --dtype bfloat16 --attention-backend triton
              --sampling-backend pytorch --enable-memory-saver --mem-fraction-static 0.3 --disable-cuda-graph
              --host 127.0.0.1 --port "$PORT")
  "$SGL" "${argv[@]}" > "$WORK/logs/sglang_conformance_server.log" 2>&1 &
  local pid=$! t=$(date +%s)
  if ! wait_health "http://127.0.0.1:$PORT" 420; then
    echo "SGLang did not become healthy"; tail -n 60 "$WORK/logs/sglang_conformance_server.log"; kill $pid; return 1
  fi
  echo "SGLang healthy after $(( $(date +%s) - t ))s"
  local version
  version=$("$SGL" -c 'import importlib.metadata as m; print(m.version("sglang"))')
  $PY scripts/record_sglang_conformance.py --url "http://127.0.0.1:$PORT" --model-path "$WORK/toy64/model" \
    --out "$WORK/fixtures/sglang-$version" --server-argv "python ${argv[*]}"
  local r=$?
  kill $pid; wait $pid 2>/dev/null
  tar -czf "$OUT/fixtures.tgz" -C "$WORK/fixtures" .
  "$SGL" scripts/gen_sglang_flags.py --stdout > "$OUT/sglang_flags_live.json" || r=1
  return $r
}

export -f conformance wait_health
for p in "$@"; do
  case $p in
    check) phase check 180 bash .offline-sglang/install.sh --check ;;
    conformance) phase conformance 300 bash -c conformance ;;
    direct) phase direct 360 $PY -m bench.gpu_sglang_serving --work "$WORK/m12" --ways sglang \
              --sglang-python "$SGL" --out "$OUT/gpu_sglang_serving_direct.json" ;;
    tests) phase tests 560 $PY -m pytest -o addopts= -p no:cacheprovider -m gpu tests/gpu/test_real_sglang.py -x \
             -q -s --timeout 540 ;;
    step) phase step 480 $PY -m bench.gpu_real_sglang_step --work "$WORK/m12" --sglang-python "$SGL" \
            --out "$OUT/gpu_real_sglang_step.json" ;;
    serving) phase serving 560 $PY -m bench.gpu_sglang_serving --work "$WORK/m12" --ways router rollout fake \
               --sglang-python "$SGL" --out "$OUT/gpu_sglang_serving.json" ;;
    *) say "unknown phase $p"; rc=1 ;;
  esac
done
tar -czf "$OUT/logs.tgz" -C "$WORK" logs $(cd "$WORK" && ls -d m12/*.log m12/*/logs 2>/dev/null) 2>/dev/null
say "done (exit $rc)"
exit $rc
