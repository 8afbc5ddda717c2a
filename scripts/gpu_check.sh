#!/usr/bin/env bash
# Kernel checks on an accelerator machine (< 5 minutes): the kernel tests compiled (not
# interpreted), the TPU-lowering tests, and the kernel-vs-reference benchmark.
#
# The Pallas kernels are Mosaic (TPU) kernels: they lower for TPU, not for GPU (Triton / Mosaic
# GPU). So on a GPU the "compiled" step is expected to fail at lowering and is reported, not
# fatal; the kernels are then checked interpreted on the GPU, and the benchmark times the
# XLA-compiled references against the interpreted kernels. On a TPU every step is compiled.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
BACKEND=$($PY -c "import jax; print(jax.default_backend())")
echo "backend: $BACKEND"
TESTS="tests/test_kernels_gdr.py tests/test_kernels_conv.py tests/test_kernels_attention.py"
status=0

echo "== kernel tests, compiled (PALLAS_INTERPRET=0)"
if ! PALLAS_INTERPRET=0 timeout 150 $PY -m pytest -q -x $TESTS; then
  if [ "$BACKEND" = "tpu" ]; then status=1; else
    echo "EXPECTED on $BACKEND: Mosaic-TPU kernels have no $BACKEND lowering"; fi
fi
if [ "$BACKEND" != "tpu" ]; then
  echo "== kernel tests, interpreted on $BACKEND (PALLAS_INTERPRET=1)"
  PALLAS_INTERPRET=1 timeout 150 $PY -m pytest -q $TESTS || status=1
fi
echo "== TPU lowering"
timeout 60 $PY -m pytest -q tests/test_kernels_lowering.py || status=1
echo "== benchmark"
timeout 120 $PY -m pallas_kernels.bench --large --iters 5 || status=1
exit $status
