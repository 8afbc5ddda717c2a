"""Peak host memory of restoring an Orbax model onto a TP mesh, vs restoring it whole first.

On CPU every forced "device" lives in this process, so per-device residency cannot show a whole
model landing on one device; the process's peak RSS can: restoring each shard straight onto its
device peaks near 1x the model's bytes, while restoring the whole model and then resharding
peaks near 2x. Usage (each mode runs in a fresh subprocess):

    python scripts/measure_restore_memory.py [--hidden 1024] [--vocab 32000] [--tp 4]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

WORKER = r"""
import dataclasses, json, resource, sys
import jax, numpy as np
from mambacache.checkpoint import restore_params
from mambacache.parallel import make_mesh, param_shardings

def rss_mib():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS")) / 1024

out_dir, mode, tp = sys.argv[1], sys.argv[2], int(sys.argv[3])
mesh = make_mesh(tp)
jax.numpy.zeros(1).block_until_ready()
base = rss_mib()
if mode == "sharded":
    _, params = restore_params(out_dir, mesh)
else:  # the naive path: the whole model on one device, then resharded
    _, params = restore_params(out_dir, None)
    params = jax.device_put(params, param_shardings(params, mesh))
jax.block_until_ready(params)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
nbytes = sum(x.nbytes for x in jax.tree.leaves(params))
print(json.dumps({"mode": mode, "model_mib": nbytes / 2**20, "base_rss_mib": base,
                  "peak_rss_mib": peak, "peak_over_model": (peak - base) / (nbytes / 2**20)}))
"""

SAVE = r"""
import dataclasses, sys
from mambacache.checkpoint import save_params
from models.params import init_params
from models.presets import get_preset
cfg = dataclasses.replace(get_preset("tiny_qwen3_next"), hidden_size=int(sys.argv[2]),
                          vocab_size=int(sys.argv[3]), num_key_value_heads=4,
                          linear_num_key_heads=4, linear_num_value_heads=8)
save_params(sys.argv[1], cfg, init_params(cfg, seed=0))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--tp", type=int, default=4)
    args = ap.parse_args()
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={args.tp}",
           "JAX_PLATFORMS": "cpu"}
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-c", SAVE, tmp + "/m", str(args.hidden), str(args.vocab)],
                       check=True, env=env)
        for mode in ("sharded", "whole_then_reshard"):
            out = subprocess.run([sys.executable, "-c", WORKER, tmp + "/m", mode, str(args.tp)],
                                 check=True, env=env, capture_output=True, text=True).stdout
            print(json.dumps(json.loads(out.strip().splitlines()[-1])))


if __name__ == "__main__":
    main()
