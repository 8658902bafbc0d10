#!/usr/bin/env bash
# A real redis-server on loopback for the agent gateway's shared session store (`--agent-store redis://...`).
#   ci/redis.sh start [PORT]   start one on 127.0.0.1 (default port 6390, no persistence), print its URL
#   ci/redis.sh stop [PORT]    stop it
#   ci/redis.sh stress [N]     two `slime gateway` processes, N sessions x 10 turns (default 100), alternating
#                              turns and finishing on the other process; prints the timing (docs/agent.md)
# The integration test (tests/integration/test_agent_redis_gateways.py) starts and stops its own server.
# redis-server comes from apt (ci/cpu.sh installs it): apt-get install -y redis-server
set -euo pipefail
cd "$(dirname "$0")/.."
cmd="${1:-}"
case "$cmd" in
  start)
    port="${2:-6390}"
    dir="runs/redis-$port"
    mkdir -p "$dir"
    redis-server --bind 127.0.0.1 --port "$port" --save "" --appendonly no --daemonize yes \
      --pidfile "$PWD/$dir/redis.pid" --logfile "$PWD/$dir/redis.log"
    for _ in $(seq 50); do
      redis-cli -h 127.0.0.1 -p "$port" ping >/dev/null 2>&1 && break
      sleep 0.1
    done
    redis-cli -h 127.0.0.1 -p "$port" ping >/dev/null
    echo "redis://127.0.0.1:$port/0"
    ;;
  stop)
    port="${2:-6390}"
    pidfile="runs/redis-$port/redis.pid"
    if [ -f "$pidfile" ]; then
      kill "$(cat "$pidfile")" 2>/dev/null || true
      rm -f "$pidfile"
    fi
    ;;
  stress)
    n="${2:-100}"
    SLIME_REDIS_STRESS_SESSIONS="$n" .venv/bin/pytest tests/integration/test_agent_redis_gateways.py \
      -q -s -n 0 2>&1 | grep -E "redis store:|passed|failed|Error"
    ;;
  *)
    echo "usage: ci/redis.sh start [PORT] | stop [PORT] | stress [N]" >&2
    exit 2
    ;;
esac
