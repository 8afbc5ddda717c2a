"""Per-device peak memory of restoring an Orbax model onto a TP mesh, vs restoring it whole first.

Each (TP, mode) runs in a fresh subprocess: ``mambacache.parallel.device_memory.measure_restore``
reports each device's peak of live jax buffers (sampled at every device-array creation point) and,
on GPU/TPU, the allocator's ``peak_bytes_in_use``; the process's peak RSS is printed beside it
(on CPU all forced devices and Orbax's host staging buffers share that one process).

Modes: ``sharded`` = ``restore_params(dir, mesh)``; ``naive`` = restore whole onto device 0,
then ``jax.device_put`` to the TP shardings. Usage:

    python scripts/measure_restore_memory.py [--hidden 1024] [--vocab 32000] [--tp 2 4]
        [--cpu-devices 4] [--out results.json]

``--cpu-devices N`` forces N host devices (CPU); ``--cpu-devices 0`` uses the real backend.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

WORKER = r"""
import json, resource, sys
import jax
from mambacache.parallel.device_memory import measure_restore

def rss_mib():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS")) / 1024

out_dir, mode, tp = sys.argv[1], sys.argv[2], int(sys.argv[3])
jax.numpy.zeros(1).block_until_ready()
base = rss_mib()
rep = measure_restore(out_dir, tp, mode)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
rep.update(backend=jax.default_backend(), base_rss_mib=base, peak_rss_mib=peak,
           rss_peak_over_model=(peak - base) / (rep["model_bytes"] / 2**20))
print(json.dumps(rep))
"""

SAVE = r"""
import dataclasses, sys
from mambacache.parallel.checkpoint import save_params
from models.params import init_params
from models.presets import get_preset
cfg = dataclasses.replace(get_preset("tiny_qwen3_next_tp4"), hidden_size=int(sys.argv[2]),
                          vocab_size=int(sys.argv[3]))
save_params(sys.argv[1], cfg, init_params(cfg, seed=0))
"""


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f}"


def table(rows: list[dict]) -> str:
    """Markdown rows: one per (TP, mode), per-device peaks as x model bytes."""
    out = ["| TP | mode | model MiB | per-device live peak / model | allocator peak / model "
           "| largest buffer MiB (largest param) | RSS peak / model |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        devs = r["devices"].values()
        live = " ".join(f"{d['peak_over_model']:.3f}" for d in devs)
        stats = [d["stats_peak_bytes"] for d in devs]
        alloc = ("n/a" if any(s is None for s in stats)
                 else " ".join(f"{s / r['model_bytes']:.3f}" for s in stats))
        out.append(f"| {r['tp']} | {r['mode']} | {_mib(r['model_bytes'])} | {live} | {alloc} "
                   f"| {_mib(r['largest_buffer']['bytes'])} ({_mib(r['largest_param_bytes'])}) "
                   f"| {r['rss_peak_over_model']:.2f} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--cpu-devices", type=int, default=4)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    env = dict(os.environ)
    if args.cpu_devices:
        if max(args.tp) > args.cpu_devices:
            raise ValueError(f"--tp {max(args.tp)} exceeds --cpu-devices {args.cpu_devices}")
        env.update(XLA_FLAGS=f"--xla_force_host_platform_device_count={args.cpu_devices}",
                   JAX_PLATFORMS="cpu")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-c", SAVE, tmp + "/m", str(args.hidden), str(args.vocab)],
                       check=True, env=env)
        for tp in args.tp:
            for mode in ("sharded", "naive"):
                out = subprocess.run([sys.executable, "-c", WORKER, tmp + "/m", mode, str(tp)],
                                     check=True, env=env, capture_output=True, text=True).stdout
                rows.append(json.loads(out.strip().splitlines()[-1]))
    print(table(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
