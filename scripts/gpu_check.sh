#!/usr/bin/env bash
# The device check (< 10 minutes on one H200 or one TPU host; each step has its own timeout,
# 570 s in all): the backend's kernel family compiled (not interpreted) against the references,
# the model with kernels="pallas" against "reference", the kernels' measured share of the
# roofline at production sizes, the cache sized from cache.memory_fraction on this device by
# the plan's code (python -m mambacache.plan --topology local) and a short cache on / off
# benchmark whose engines size their pools from the same cache.memory_fraction. Writes $OUT_DIR/device_check.json (scripts/device_report.py):
# per kernel the measured fraction of HBM bandwidth and of peak FLOPs, the plan, the ratios and
# each step's exit status.
#
#   GPU: the Pallas-Triton kernels (pallas_kernels/gpu/, tests/test_kernels_gpu_*.py).
#   TPU: the Mosaic kernels (pallas_kernels/tpu/, tests/test_kernels_{gdr,conv,attention}.py).
# Usage: scripts/gpu_check.sh  (PYTHON=..., OUT_DIR=device_check, MEMORY_FRACTION=0.05;
# EXPECT=gpu|tpu fails early on another backend: scripts/tpu_check.sh). Exit 1 if any step fails.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT=${OUT_DIR:-device_check}
FRACTION=${MEMORY_FRACTION:-0.05}  # of what is left after weights + step: the tiny bench model
mkdir -p "$OUT"
BACKEND=$($PY -c "import jax; print(jax.default_backend(), jax.devices()[0].device_kind)")
echo "backend: $BACKEND"
case "$BACKEND" in
  gpu*) FAMILY=gpu; TESTS="tests/test_kernels_gpu_gdr.py tests/test_kernels_gpu_conv.py tests/test_kernels_gpu_attention.py tests/test_kernels_mla.py tests/test_kernels_gpu_ssd.py" ;;
  tpu*) FAMILY=tpu; TESTS="tests/test_kernels_gdr.py tests/test_kernels_conv.py tests/test_kernels_attention.py" ;;
  *) echo "no accelerator: run the normal test suite instead (kernels interpreted)"; exit 1 ;;
esac
if [ -n "${EXPECT:-}" ] && [ "$EXPECT" != "$FAMILY" ]; then
  echo "expected a $EXPECT backend, found $BACKEND"; exit 1
fi
status=0
STEPS="$OUT/steps.txt"; : > "$STEPS"
step() {  # step NAME SECONDS CMD...: run with a timeout, record the exit status
  local name=$1 limit=$2; shift 2
  echo "== $name"
  timeout "$limit" "$@"; local rc=$?
  echo "$name $rc" >> "$STEPS"
  [ $rc -eq 0 ] || status=1
}
KDA=""
[ "$FAMILY" = gpu ] && KDA=tests/test_kernels_kda.py  # its GPU half (-k gpu), compiled
step kernel_tests 150 env PALLAS_INTERPRET=0 $PY -m pytest -q -p no:cacheprovider -n 0 $TESTS
[ -n "$KDA" ] && step kda_tests 60 env PALLAS_INTERPRET=0 $PY -m pytest -q -p no:cacheprovider \
  -n 0 "$KDA" -k "gpu and not emulated"
step model_vs_reference 60 env PALLAS_INTERPRET=0 $PY -m pytest -q -p no:cacheprovider -n 0 \
  tests/test_model_forward.py -k "pallas_kernels_match_reference and $FAMILY"
step kernel_roofline 120 $PY -m pallas_kernels.bench --large --iters 5 --out "$OUT/kernels.json"
BENCH="configs/bench/multi_turn.toml"
step plan 90 $PY -m mambacache.plan --config "$BENCH" --topology local \
  --set cache.memory_fraction="$FRACTION" --set cache.num_kv_tokens=0 --set cache.num_mamba_slots=0 \
  --set cache.page_size=16 --out "$OUT/plan.json"
# the engine sizes its own pools from the same fraction (engine/pools.size_pools with the
# budget parallel.sizing.device_cache_budget measures), as a user who sets only the fraction gets
step bench_cache_on_off 90 $PY -m mambacache.bench --config "$BENCH" --quiet \
  --set cache.memory_fraction="$FRACTION" --set cache.num_kv_tokens=0 --set cache.num_mamba_slots=0 \
  --set cache.page_size=16 --out "$OUT/bench.json"
$PY -c "import json, sys; print(json.dumps({l.split()[0]: int(l.split()[1]) \
for l in open('$STEPS')}))" > "$OUT/steps.json"
$PY scripts/device_report.py "$OUT" || status=1
exit $status
