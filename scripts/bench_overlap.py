"""``scheduler.overlap`` on vs off in one process, with the cache on:

    python scripts/bench_overlap.py --config configs/bench/no_reuse.toml [--pairs 5]
                                    [--set section.key=value ...] [--out result.json]

One loaded model; one untimed warm-up pass per mode (compiles everything); then ``--pairs``
alternating pairs (on, off), (off, on), ... of the whole workload. Prints per mode the medians of
output throughput, device_idle_share (wall time with no step in flight), host_bound_share and
host_share, and the median of the per-pair throughput ratios on / off.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from mambacache.bench.cli import load_setup
from mambacache.bench.runner import run_pass
from mambacache.config import parse_set_args

KEYS = ("output_throughput", "device_idle_share", "host_bound_share", "host_share", "num_steps")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--set", dest="sets", action="append", default=[])
    p.add_argument("--out")
    args = p.parse_args(argv)
    from mambacache.engine.engine import Engine, load_model

    setup = load_setup(args.config, parse_set_args(args.sets))
    model = load_model(setup.engine)
    cfgs = {on: setup.engine.replace(**{"cache.enable": True, "scheduler.overlap": on})
            for on in (True, False)}

    def one(on: bool) -> dict:
        engine = Engine(cfgs[on], model=model)
        source = setup.workload.source(model[0].vocab_size, setup.bench.seed)
        stats = run_pass(engine, source, setup.bench)
        return {k: stats.get(k) for k in KEYS}

    for on in (True, False):
        one(on)  # warm-up: compiles
    runs: dict[bool, list[dict]] = {True: [], False: []}
    for i in range(args.pairs):
        for on in ((True, False) if i % 2 == 0 else (False, True)):
            runs[on].append(one(on))
            print(f"pair {i + 1} overlap={on}: {runs[on][-1]}", flush=True)
    ratio = [a["output_throughput"] / b["output_throughput"]
             for a, b in zip(runs[True], runs[False], strict=True)]
    result = {"config": args.config, "pairs": args.pairs,
              "overlap_on": {k: _median(runs[True], k) for k in KEYS},
              "overlap_off": {k: _median(runs[False], k) for k in KEYS},
              "output_throughput_ratio_median": float(np.median(ratio)),
              "output_throughput_ratios": ratio}
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return result


def _median(runs: list[dict], key: str) -> float | None:
    vals = [r[key] for r in runs if r[key] is not None]
    return float(np.median(vals)) if vals else None


if __name__ == "__main__":
    main()
