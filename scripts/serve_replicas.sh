#!/usr/bin/env bash
# N engines behind SGLang's gateway (smg) or router (sglang-router), cache-aware routing.
#
#   pip install -e '.[serve,router]'
#   bash scripts/serve_replicas.sh [N=2] [ROUTER=smg] [POLICY=cache_aware] [CONFIG] [-- --set k=v ...]
#
# Replica i serves on port BASE_PORT+1+i (BASE_PORT=8000: the router on 8000, engines on
# 8001..8000+N), one per device: with VISIBLE_ENV set (CUDA_VISIBLE_DEVICES on GPUs,
# TPU_VISIBLE_CHIPS on TPU hosts) replica i sees device i only. Replicas on other hosts: start
# `python -m mambacache.serve --port P` on each and pass them as WORKERS="http://h1:P http://h2:P"
# (then this script starts only the router). HOST (default 127.0.0.1) is where everything binds.
# Clients talk to the router: the OpenAI routes, SGLang's /generate, /v1/models. Ctrl-C stops all.
# Checked by tests/test_router.py (pytest -m router -n 0 tests/test_router.py).
set -euo pipefail
N=${1:-2}
ROUTER=${2:-smg}
POLICY=${3:-cache_aware}
CONFIG=${4:-}
shift $(( $# < 4 ? $# : 4 ))
[ "${1:-}" = "--" ] && shift
HOST=${HOST:-127.0.0.1}
BASE_PORT=${BASE_PORT:-8000}
PY=${PYTHON:-python}
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait; }
trap cleanup EXIT INT TERM

workers=()
if [ -n "${WORKERS:-}" ]; then
  read -r -a workers <<< "$WORKERS"
else
  for i in $(seq 0 $((N - 1))); do
    port=$((BASE_PORT + 1 + i))
    env_pin=()
    [ -n "${VISIBLE_ENV:-}" ] && env_pin=("$VISIBLE_ENV=$i")
    env "${env_pin[@]}" "$PY" -m mambacache.serve ${CONFIG:+--config "$CONFIG"} \
      --host "$HOST" --port "$port" "$@" > "replica_$i.log" 2>&1 &
    pids+=($!)
    workers+=("http://$HOST:$port")
  done
  for w in "${workers[@]}"; do  # /health is 200 once the engine is loaded and warmed up
    until curl -sf "$w/health" > /dev/null; do sleep 1; done
    echo "ready: $w"
  done
fi
"$ROUTER" launch --host "$HOST" --port "$BASE_PORT" --policy "$POLICY" \
  --worker-urls "${workers[@]}" --prometheus-host "$HOST" \
  --prometheus-port $((BASE_PORT + 900)) &
pids+=($!)
echo "router: http://$HOST:$BASE_PORT ($ROUTER, $POLICY) over ${workers[*]}"
wait
