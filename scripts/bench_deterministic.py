"""``model.deterministic`` on vs off in one process (issue 28: the mode's throughput cost):

    python scripts/bench_deterministic.py --config configs/bench/no_reuse.toml [--pairs 3]
        [--set section.key=value ...] [--out result.json]

One loaded model; one untimed warm-up pass per mode (compiles); then ``--pairs`` alternating
pairs (default, deterministic), (deterministic, default), ... of the whole workload. Prints the
median output and request throughput per mode and the per-pair ratios deterministic / default.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np

KEYS = ("output_throughput", "request_throughput", "num_steps")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--set", dest="sets", action="append", default=[])
    p.add_argument("--out")
    args = p.parse_args(argv)
    from mambacache.bench.cli import load_setup
    from mambacache.bench.runner import alternating_pairs
    from mambacache.config import parse_set_args
    from mambacache.engine.engine import load_model

    load_before = os.getloadavg()
    setup = load_setup(args.config, parse_set_args(args.sets))
    model = load_model(setup.engine)
    cfgs = {on: setup.engine.replace(**{"model.deterministic": on}) for on in (False, True)}

    runs = alternating_pairs(cfgs, model, setup, args.pairs, KEYS, "deterministic")
    ratio = [a["output_throughput"] / b["output_throughput"]
             for a, b in zip(runs[True], runs[False], strict=True)]
    result = {"config": args.config, "sets": args.sets, "pairs": args.pairs,
              "load_avg_1_5_15_before": [round(x, 2) for x in load_before],
              "load_avg_1_5_15_after": [round(x, 2) for x in os.getloadavg()],
              "default": {k: float(np.median([r[k] for r in runs[False]])) for k in KEYS},
              "deterministic": {k: float(np.median([r[k] for r in runs[True]])) for k in KEYS},
              "output_throughput_ratio_median": float(np.median(ratio)),
              "output_throughput_ratios": ratio}
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
