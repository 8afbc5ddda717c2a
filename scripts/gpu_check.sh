#!/usr/bin/env bash
# Kernel checks on an accelerator machine (< 5 minutes): the backend's kernel family compiled
# (not interpreted) against the references, the model with kernels="pallas" against
# "reference", the lowering tests, and the kernel-vs-reference benchmark at production sizes.
#
#   GPU: the Pallas-Triton kernels (pallas_kernels/gpu/, tests/test_kernels_gpu_*.py).
#   TPU: the Mosaic kernels (pallas_kernels/tpu/, tests/test_kernels_{gdr,conv,attention}.py).
# Usage: scripts/gpu_check.sh  (PYTHON=... to pick the interpreter). Exit status 1 if any fails.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
BACKEND=$($PY -c "import jax; print(jax.default_backend(), jax.devices()[0].device_kind)")
echo "backend: $BACKEND"
case "$BACKEND" in
  gpu*) FAMILY=gpu; TESTS="tests/test_kernels_gpu_gdr.py tests/test_kernels_gpu_conv.py tests/test_kernels_gpu_attention.py tests/test_kernels_mla.py tests/test_kernels_gpu_ssd.py" ;;
  tpu*) FAMILY=tpu; TESTS="tests/test_kernels_gdr.py tests/test_kernels_conv.py tests/test_kernels_attention.py" ;;
  *) echo "no accelerator: run the normal test suite instead (kernels interpreted)"; exit 1 ;;
esac
status=0
echo "== kernel tests, compiled (PALLAS_INTERPRET=0)"
PALLAS_INTERPRET=0 timeout 150 $PY -m pytest -q -p no:cacheprovider $TESTS || status=1
if [ "$FAMILY" = gpu ]; then  # the KDA file holds both families: its GPU half, compiled
  PALLAS_INTERPRET=0 timeout 90 $PY -m pytest -q -p no:cacheprovider tests/test_kernels_kda.py \
    -k "gpu and not emulated" || status=1
fi
echo "== model: kernels=pallas (compiled) vs reference"
PALLAS_INTERPRET=0 timeout 90 $PY -m pytest -q -p no:cacheprovider \
  tests/test_model_forward.py -k "pallas_kernels_match_reference and $FAMILY" || status=1
echo "== lowering (TPU Mosaic and GPU Triton, from this host)"
timeout 60 $PY -m pytest -q -p no:cacheprovider tests/test_kernels_lowering.py \
  tests/test_kernels_gpu_gdr.py tests/test_kernels_gpu_conv.py tests/test_kernels_gpu_attention.py \
  tests/test_kernels_mla.py tests/test_kernels_gpu_ssd.py \
  -k "lower" || status=1
echo "== benchmark (kernel vs XLA-compiled reference, production sizes)"
timeout 120 $PY -m pallas_kernels.bench --large --iters 5 || status=1
exit $status
