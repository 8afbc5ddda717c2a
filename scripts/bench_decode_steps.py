"""``scheduler.decode_steps`` 1 vs K (multi-step decode) in one process, with the cache on:

    python scripts/bench_decode_steps.py --config configs/bench/multi_turn.toml [--k 8]
        [--pairs 3] [--set section.key=value ...] [--out result.json]

One loaded model; one untimed pass per K (compiles what the workload runs); then ``--pairs``
alternating pairs of the whole workload (``bench.runner.alternating_pairs``). Prints per K the
medians of output throughput, TTFT p50, TPOT mean, steps, host share and the XLA compiles of the
timed passes (0: nothing compiled while timed), and the per-pair throughput ratios K / 1.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

KEYS = ("output_throughput", "ttft_p50", "tpot_mean", "num_steps", "host_share",
        "programs_compiled")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("--k", type=int, default=8, help="scheduler.decode_steps against 1")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--set", dest="sets", action="append", default=[])
    p.add_argument("--out")
    args = p.parse_args(argv)
    from mambacache.bench.cli import load_setup
    from mambacache.bench.report import write_json
    from mambacache.bench.runner import alternating_pairs
    from mambacache.config import parse_set_args
    from mambacache.engine.engine import load_model

    setup = load_setup(args.config, parse_set_args(args.sets))
    model = load_model(setup.engine)
    cfgs = {k: setup.engine.replace(**{"cache.enable": True, "scheduler.decode_steps": k})
            for k in (1, args.k)}
    runs = alternating_pairs(cfgs, model, setup, args.pairs, KEYS, "decode_steps")
    result = {"config": args.config, "sets": args.sets, "pairs": args.pairs,
              **summary(runs, args.k)}
    print(json.dumps(result, indent=2))
    if args.out:
        write_json(result, args.out)
    return result


def summary(runs: dict[int, list[dict]], k: int) -> dict:
    """Medians per K, the compiles of every timed pass, the throughput ratios K / 1 per pair."""
    ratio = [a["output_throughput"] / b["output_throughput"]
             for a, b in zip(runs[k], runs[1], strict=True)]
    medians = {f"decode_steps_{n}": {key: float(np.median([r[key] for r in runs[n]]))
                                     for key in KEYS} for n in runs}
    return {**medians,
            "compiles_while_timed": sum(r["programs_compiled"] for n in runs for r in runs[n]),
            "output_throughput_ratio_median": float(np.median(ratio)),
            "output_throughput_ratios": ratio}


if __name__ == "__main__":
    main()
