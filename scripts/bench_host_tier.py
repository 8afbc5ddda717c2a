"""A device pool too small for the conversations, with and without a host tier, in one process:

    python scripts/bench_host_tier.py --config configs/bench/multi_turn.toml [--pairs 3]
        [--set cache.num_kv_tokens=1536 --set cache.num_mamba_slots=16]
        [--host-bytes 268435456] [--out result.json]

One loaded model; one untimed pass per mode (compiles the steps and the tier's gather /
scatter programs); then ``--pairs`` alternating pairs (tier, device), (device, tier), ... of the
whole workload on fresh engines. Prints per mode the medians of TTFT (mean, p99), computed
prefill tokens, hit rate, request throughput and the tier's counters (``host_hit_tokens``,
``load_wait_s``). Exactness is the tests' (``tests/test_host_tier_engine.py``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

KEYS = ("ttft_mean", "ttft_p99", "computed_prefill_tokens", "hit_rate", "request_throughput",
        "host_hit_tokens", "load_wait_s", "load_wait_steps", "promotions", "demotions")
SMALL = {"cache.num_kv_tokens": 1536, "cache.num_mamba_slots": 16}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--host-bytes", type=int, default=256 * 2**20)
    p.add_argument("--set", dest="sets", action="append", default=[])
    p.add_argument("--out")
    args = p.parse_args(argv)
    from mambacache.bench.cli import load_setup
    from mambacache.bench.runner import run_pass
    from mambacache.config import parse_set_args
    from mambacache.engine.engine import Engine, load_model

    setup = load_setup(args.config, {**SMALL, **parse_set_args(args.sets)})
    model = load_model(setup.engine)
    cfgs = {"device": setup.engine,
            "tier": setup.engine.replace(**{"cache.host_memory_bytes": args.host_bytes})}

    def one(mode: str) -> dict:
        engine = Engine(cfgs[mode], model=model)
        source = setup.workload.source(model[0].vocab_size, setup.bench.seed)
        stats = run_pass(engine, source, setup.bench)
        m = engine.metrics()
        return {k: stats.get(k, m.get(k)) for k in KEYS}

    for mode in cfgs:
        one(mode)  # warm-up: compiles
    runs: dict[str, list[dict]] = {mode: [] for mode in cfgs}
    for i in range(args.pairs):
        for mode in (("tier", "device") if i % 2 == 0 else ("device", "tier")):
            runs[mode].append(one(mode))
            print(f"pair {i + 1} {mode}: {runs[mode][-1]}", flush=True)
    result = {"config": args.config, "pairs": args.pairs, "host_bytes": args.host_bytes,
              "pools": {k: getattr(setup.engine.cache, k.split(".")[1]) for k in SMALL},
              **{mode: {k: _median(rows, k) for k in KEYS} for mode, rows in runs.items()}}
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return result


def _median(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return float(np.median(vals)) if vals else None


if __name__ == "__main__":
    main()
