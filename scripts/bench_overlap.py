"""``scheduler.overlap`` on vs off in one process, with the cache on:

    python scripts/bench_overlap.py --config configs/bench/no_reuse.toml [--pairs 5]
        [--device-threads N] [--set section.key=value ...] [--out result.json]

One loaded model; one untimed warm-up pass per mode (compiles everything); then ``--pairs``
alternating pairs (on, off), (off, on), ... of the whole workload. Prints per mode the medians of
output throughput, device_idle_share (wall time with no step in flight), host_bound_share,
host_share and steps, and the per-pair throughput ratios on / off (median, min, max).

``--device-threads N``: XLA's CPU client runs compiled programs on N threads (the ``NPROC``
variable XLA reads when it creates the client; set here before JAX starts). Without it XLA sizes
its pool to every core, so on a CPU the "device" and the host thread share the same cores; with
N = cores - 1 the host thread keeps a core, the way a GPU or TPU is a separate processor. The
setting and the machine's load average (before and after) are part of the result.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np

KEYS = ("output_throughput", "device_idle_share", "host_bound_share", "host_share", "num_steps",
        "spec_tokens_per_verify", "spec_accept_rate")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--device-threads", type=int, default=None,
                   help="XLA CPU threads for compiled programs (default: XLA's, every core)")
    p.add_argument("--set", dest="sets", action="append", default=[])
    p.add_argument("--out")
    args = p.parse_args(argv)
    if args.device_threads is not None:
        set_device_threads(args.device_threads)
    from mambacache.bench.cli import load_setup
    from mambacache.bench.runner import alternating_pairs
    from mambacache.config import parse_set_args
    from mambacache.engine.engine import load_model

    load_before = os.getloadavg()
    setup = load_setup(args.config, parse_set_args(args.sets))
    model = load_model(setup.engine)
    cfgs = {on: setup.engine.replace(**{"cache.enable": True, "scheduler.overlap": on})
            for on in (True, False)}

    runs = alternating_pairs(cfgs, model, setup, args.pairs, KEYS, "overlap")
    ratio = [a["output_throughput"] / b["output_throughput"]
             for a, b in zip(runs[True], runs[False], strict=True)]
    result = {"config": args.config, "pairs": args.pairs,
              "device_threads": args.device_threads or "default",
              "load_avg_1_5_15_before": [round(x, 2) for x in load_before],
              "load_avg_1_5_15_after": [round(x, 2) for x in os.getloadavg()],
              "overlap_on": {k: _median(runs[True], k) for k in KEYS},
              "overlap_off": {k: _median(runs[False], k) for k in KEYS},
              "output_throughput_ratio_median": float(np.median(ratio)),
              "output_throughput_ratio_min_max": [float(min(ratio)), float(max(ratio))],
              "output_throughput_ratios": ratio}
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return result


def set_device_threads(n: int) -> None:
    """Size XLA's CPU thread pool to ``n`` threads; only before JAX has created its client."""
    if n < 1:
        raise ValueError(f"--device-threads must be >= 1, got {n}")
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        raise ValueError("--device-threads must be set before JAX creates its CPU client")
    os.environ["NPROC"] = str(n)  # XLA's DefaultThreadPoolSize() reads it


def _median(runs: list[dict], key: str) -> float | None:
    vals = [r[key] for r in runs if r[key] is not None]
    return float(np.median(vals)) if vals else None


if __name__ == "__main__":
    main()
