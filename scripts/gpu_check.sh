#!/usr/bin/env bash
# The device check: runs where the hardware is, on an image as it is (Python 3.12, jax 0.11.2 or
# newer, pytest; nothing installed: the project runs from this checkout on PYTHONPATH, pytest
# without xdist), in under 8 minutes (each step has its own timeout, 480 s in all). Steps:
#   kernel_tests        the backend's kernel family compiled (PALLAS_INTERPRET=0) against the
#                       references (GPU: the Triton kernels + KDA's GPU half; TPU: Mosaic)
#   model_vs_reference  the model with kernels="pallas" against "reference"
#   exactness_fp32      cache on = off through the engine in fp32 with the compiled kernels
#                       (tests/test_engine_exactness.py: tokens equal, logprobs within 1e-4;
#                       float32 runs at HIGHEST matmul precision, models/precision.py)
#   agreement_{fp32,bf16}  python -m mambacache.bench.agreement: next-token KL / argmax and greedy
#                       agreement, cache on vs off (bf16 is the serving dtype)
#   step_bench          python -m mambacache.bench.step at real size (STEP_PRESET, default
#                       qwen3_5_35b_a3b, bf16): decode / prefill / the MoE against the roofline
# FULL=1 adds the older steps: kernel roofline fractions, the plan on this device, a short cache
# on / off benchmark. Writes $OUT_DIR/device_check.json (scripts/device_report.py): each step's
# exit status and what each step wrote. Exit 1 if any step fails.
# Usage: scripts/gpu_check.sh   (PYTHON=python3, OUT_DIR=device_check, STEP_PRESET=...,
#   EXPECT=gpu|tpu fails early on another backend: scripts/tpu_check.sh; CPU_DRY_RUN=1 runs
#   the same steps interpreted on CPU at the tiny preset, to check the script itself)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
OUT=${OUT_DIR:-device_check}
mkdir -p "$OUT"
BACKEND=$($PY -c "import jax; print(jax.default_backend(), jax.__version__, jax.devices()[0].device_kind)")
echo "backend: $BACKEND"
INTERPRET=0
SCALE=1  # of every step's timeout
PRESET=${STEP_PRESET:-qwen3_5_35b_a3b}
case "$BACKEND" in
  gpu*) FAMILY=gpu ;;
  tpu*) FAMILY=tpu ;;
  cpu*) if [ "${CPU_DRY_RUN:-0}" = 1 ]; then FAMILY=gpu; INTERPRET=1; SCALE=10
        PRESET=tiny_qwen3_5_moe
        else echo "no accelerator: run the test suite instead (or CPU_DRY_RUN=1)"; exit 1; fi ;;
  *) echo "unknown backend $BACKEND"; exit 1 ;;
esac
if [ -n "${EXPECT:-}" ] && [ "$EXPECT" != "$FAMILY" ]; then
  echo "expected a $EXPECT backend, found $BACKEND"; exit 1
fi
case "$FAMILY" in
  gpu) TESTS="tests/test_kernels_gpu_gdr.py tests/test_kernels_gpu_conv.py
              tests/test_kernels_gpu_attention.py tests/test_kernels_mla.py
              tests/test_kernels_gpu_ssd.py" ;;
  tpu) TESTS="tests/test_kernels_gdr.py tests/test_kernels_conv.py
              tests/test_kernels_attention.py" ;;
esac
[ -f tests/test_kernels_grouped_matmul.py ] && TESTS="$TESTS tests/test_kernels_grouped_matmul.py"
status=0
STEPS="$OUT/steps.txt"; : > "$STEPS"
step() {  # step NAME SECONDS CMD...: run with a timeout, record the exit status
  local name=$1 limit=$(($2 * SCALE)); shift 2
  echo "== $name (limit ${limit}s)"
  local t0=$SECONDS
  timeout "$limit" "$@"; local rc=$?
  echo "$name $rc $((SECONDS - t0))" >> "$STEPS"
  [ $rc -eq 0 ] || status=1
}
# the image has pytest but maybe not xdist: the ini's "-n 2" is dropped, the markers kept
PYTEST=($PY -m pytest -q -p no:cacheprovider -o addopts= -m "not slow and not aot")
KERNELS=(env PALLAS_INTERPRET=$INTERPRET PALLAS_FAMILY=$FAMILY)
step kernel_tests 120 "${KERNELS[@]}" "${PYTEST[@]}" $TESTS
[ "$FAMILY" = gpu ] && step kda_tests 40 "${KERNELS[@]}" "${PYTEST[@]}" \
  tests/test_kernels_kda.py -k "gpu and not emulated"
step model_vs_reference 40 "${KERNELS[@]}" "${PYTEST[@]}" tests/test_model_forward.py \
  -k "pallas_kernels_match_reference and $FAMILY"
step exactness_fp32 60 "${KERNELS[@]}" "${PYTEST[@]}" tests/test_engine_exactness.py
AGREE=(--set cache.page_size=16 --set model.kernels='"pallas"')
step agreement_fp32 20 "${KERNELS[@]}" $PY -m mambacache.bench.agreement "${AGREE[@]}" \
  --out "$OUT/agreement_fp32.json"
step agreement_bf16 20 "${KERNELS[@]}" $PY -m mambacache.bench.agreement "${AGREE[@]}" \
  --set model.dtype='"bfloat16"' --out "$OUT/agreement_bf16.json"
if $PY -c "import mambacache.bench.step" 2>/dev/null; then
  # the model with the Pallas kernels (a real-size reference model compiles for minutes); the
  # MoE alone runs in every form (kernel / dense / ragged_dot): the before / after pair
  step step_bench 180 "${KERNELS[@]}" $PY -m mambacache.bench.step --preset "$PRESET" \
    --rows 64 --context 1024 --prefill 4x512 --kernels pallas --out "$OUT/step.json"
else
  echo "step_bench missing (mambacache.bench.step)"; echo "step_bench missing 0" >> "$STEPS"
  status=1
fi
if [ "${FULL:-0}" = 1 ]; then
  BENCH="configs/bench/multi_turn.toml"
  POOLS=(--set cache.memory_fraction=0.05 --set cache.num_kv_tokens=0
         --set cache.num_mamba_slots=0 --set cache.page_size=16)
  step kernel_roofline 120 $PY -m pallas_kernels.bench --large --iters 5 --out "$OUT/kernels.json"
  step plan 90 $PY -m mambacache.plan --config "$BENCH" --topology local "${POOLS[@]}" \
    --out "$OUT/plan.json"
  step bench_cache_on_off 90 $PY -m mambacache.bench --config "$BENCH" --quiet "${POOLS[@]}" \
    --out "$OUT/bench.json"
fi
$PY scripts/device_report.py "$OUT" "$BACKEND" || status=1
exit $status
