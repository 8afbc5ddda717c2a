#!/usr/bin/env bash
# Multi-host tensor parallel: one engine process per host, all driving the same program.
# Every process runs this script with the same COORDINATOR and NUM_PROCESSES and its own
# PROCESS_ID (0..NUM_PROCESSES-1); see docs/parallel.md. Example, two processes on one machine
# (CPU, 1 device each -> a TP-2 mesh):
#   COORDINATOR=127.0.0.1:12345 NUM_PROCESSES=2 PROCESS_ID=0 scripts/multihost.sh &
#   COORDINATOR=127.0.0.1:12345 NUM_PROCESSES=2 PROCESS_ID=1 scripts/multihost.sh
set -euo pipefail
: "${COORDINATOR:?host:port of process 0}" "${NUM_PROCESSES:?}" "${PROCESS_ID:?}"
TP="${TP:-2}"
PY="${PYTHON:-python}"
exec "$PY" - <<PYEOF
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU only; no-op elsewhere
jax.distributed.initialize("${COORDINATOR}", num_processes=${NUM_PROCESSES},
                           process_id=${PROCESS_ID})
import mambacache as mc
cfg = mc.EngineConfig().replace(**{"parallel.tensor_parallel": ${TP},
                                   "model.kernels": "reference"})
engine = mc.Engine(cfg)   # the same seeded params on every host; mesh over all processes' devices
outs = engine.generate([[5, 17, 3, 99]], mc.SamplingParams(max_new_tokens=8))
print(jax.process_index(), outs[0].output_token_ids)
PYEOF
