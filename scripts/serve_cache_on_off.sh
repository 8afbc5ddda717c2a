#!/usr/bin/env bash
# Cache on vs off through HTTP (README "Serve"): for each mode, start `python -m mambacache.serve`
# with $CONFIG (default: the in-process gsp_identical benchmark's engine settings), run one
# untimed pass of the workload (compiles its shapes), then REPEATS measured passes with new
# prompts each (seeds 1..REPEATS), appended to $OUT/cache_{on,off}.jsonl; prints the medians side
# by side. Extra arguments replace the workload flags below.
set -euo pipefail
cd "$(dirname "$0")/.."
PORT=${PORT:-8765}
CONFIG=${CONFIG:-configs/bench/gsp_identical.toml}
OUT=${OUT:-/tmp/serve_cache_on_off}
REPEATS=${REPEATS:-3}
WORKLOAD=(--dataset-name generated-shared-prefix --gsp-num-groups 4 --gsp-prompts-per-group 32
          --gsp-system-prompt-len 1024 --gsp-question-len 0 --gsp-output-len 4)
[ $# -gt 0 ] && WORKLOAD=("$@")
mkdir -p "$OUT"
for mode in on off; do
  enable=true; [ "$mode" = off ] && enable=false
  rm -f "$OUT/cache_$mode.jsonl"
  python -m mambacache.serve --config "$CONFIG" --set cache.enable=$enable \
    --port "$PORT" --log-level warning &
  pid=$!
  trap 'kill $pid 2>/dev/null || true' EXIT
  until curl -sf "localhost:$PORT/health" >/dev/null; do
    kill -0 "$pid" 2>/dev/null || { echo "the server exited" >&2; exit 1; }
    sleep 1
  done
  python -m mambacache.bench_serving --port "$PORT" "${WORKLOAD[@]}" --seed 100 --disable-tqdm \
    >/dev/null
  for seed in $(seq "$REPEATS"); do
    python -m mambacache.bench_serving --port "$PORT" "${WORKLOAD[@]}" --seed "$seed" \
      --disable-tqdm --output-file "$OUT/cache_$mode.jsonl" >/dev/null
  done
  kill "$pid"; wait "$pid" 2>/dev/null || true
done
python - "$OUT" <<'PY'
import json, statistics, sys
keys = ("request_throughput", "input_throughput", "output_throughput", "ttft_mean", "ttft_p99",
        "itl_mean", "cached_share", "ideal_cached_share")
med = {}
for mode in ("on", "off"):
    runs = [json.loads(line) for line in open(f"{sys.argv[1]}/cache_{mode}.jsonl")]
    med[mode] = {k: statistics.median(r[k] for r in runs) for k in keys}
    print(f"cache {mode}: " + ", ".join(f"{k} {med[mode][k]:.4g}" for k in keys)
          + f" (median of {len(runs)}; input_throughput per run "
          + ", ".join(f"{r['input_throughput']:.0f}" for r in runs) + ")")
print(f"on/off input throughput: {med['on']['input_throughput'] / med['off']['input_throughput']:.2f}x")
PY
