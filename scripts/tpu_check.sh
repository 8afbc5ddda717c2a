#!/usr/bin/env bash
# The TPU twin of scripts/gpu_check.sh: the same steps on one TPU host (Mosaic kernels compiled,
# model vs references, kernel roofline fractions, the cache sized from cache.memory_fraction by
# the plan, a short cache on / off bench; $OUT_DIR/device_check.json), failing early unless the
# backend is a TPU. Usage: scripts/tpu_check.sh (PYTHON, OUT_DIR, MEMORY_FRACTION as there).
EXPECT=tpu exec "$(dirname "$0")/gpu_check.sh" "$@"
