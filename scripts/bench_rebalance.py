"""The moving device split (``cache.rebalance``) against the fixed one, side by side in one process.

    python scripts/bench_rebalance.py --trace agent.jsonl --gib 1 [--concurrency 1] \
        [--preset qwen3_next_80b_a3b | --state-bytes B --kv-bytes-per-token B] [--requests N] \
        [--device-cost] [--out result.json]

Hit rates through the engine on the shadow runner (``mambacache.bench.simulate``: the engine's
scheduler and cache, every read checked), one trace, one budget:

* ``fixed``: device pools split at the formula's share (``device_state_share``), never moving
  (what the model engine does with ``cache.rebalance = false``);
* ``moving``: the same start, the split moving with the workload (``cache.rebalance = true``);
* ``split_k``: pinned at each of the quantised splits (the best a fixed choice among them does);
* ``shared``: KV and states on one host byte budget (no device split: the host-only bound).

``--device-cost``: the tiny model on this machine, ``cache.rebalance`` on: the warm-up's
programs per split and its compiles, then one move with rows in the tree (seconds of the layer
by layer copy) and the XLA compiles of the steps after it (0: warmed).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from mambacache.bench.simulate import load_trace, simulate
from mambacache.cache.rebalance import SplitTuner
from mambacache.config import EngineConfig

NEVER = 1 << 40  # a tuner cadence that never comes


def _pin(k: int | None):
    def hook(engine: Any) -> None:
        engine.rebalancer.use_tuner(SplitTuner(every=NEVER))
        if k is not None:
            engine.rebalancer.move_now(k)
    return hook


def hit_rates(records: list, cfg: EngineConfig, concurrency: int) -> dict[str, Any]:
    moving_cfg = cfg.replace(**{"cache.rebalance": True})
    out: dict[str, Any] = {}
    runs = {"fixed": (moving_cfg, _pin(None)), "moving": (moving_cfg, None),
            "shared": (cfg, None)}
    for name, (c, hook) in runs.items():
        t0 = time.perf_counter()
        res = simulate(records, c, concurrency, on_engine=hook)
        out[name] = {k: res.get(k) for k in ("hit_rate", "steps", "preemptions", "split_moves",
                                              "device_split", "device_splits", "split_history",
                                              "us_per_request")}
        out[name]["seconds"] = time.perf_counter() - t0
        print(name, json.dumps(out[name]), flush=True)
    for k in range(len(out["fixed"]["device_splits"])):
        res = simulate(records, moving_cfg, concurrency, on_engine=_pin(k))
        out[f"split_{k}"] = {"hit_rate": res["hit_rate"], "device_split": res["device_split"]}
        print(f"split_{k}", json.dumps(out[f"split_{k}"]), flush=True)
    return out


def device_cost() -> dict[str, Any]:
    """The tiny model: warm-up over every split, one move with rows cached, steps after it."""
    import numpy as np

    import mambacache as mc
    from mambacache.engine.engine import Engine

    cfg = mc.EngineConfig().replace(**{
        "cache.memory_bytes": 1_606_400, "cache.num_kv_tokens": 0, "cache.num_mamba_slots": 0,
        "cache.rebalance": True, "scheduler.max_running_requests": 4,
        "scheduler.chunked_prefill_size": 64, "model.kernels": "reference"})
    engine = Engine(cfg)
    rb = engine.rebalancer
    warm = engine.warmup(max_seq_len=128)
    rng = np.random.default_rng(0)
    vocab = engine.model_cfg.vocab_size
    head = rng.integers(0, vocab, 40).tolist()
    prompts = [head + rng.integers(0, vocab, 5).tolist() for _ in range(4)]
    params = mc.SamplingParams(max_new_tokens=4, temperature=0.0)
    engine.generate(prompts, params)
    before = engine.metrics()
    t0 = time.perf_counter()
    rb.move_now((rb.current + 1) % len(rb.splits))
    move_s = time.perf_counter() - t0
    engine.generate(prompts, params)
    after = engine.metrics()
    return {"splits": [list(s) for s in rb.splits], "warmup_programs": warm["programs"],
            "warmup_splits": warm["device_splits"], "warmup_compiles": warm["compiles"],
            "warmup_s": warm["seconds"], "move_s": move_s,
            "compiles_in_move_and_steps_after": after["programs_compiled"]
            - before["programs_compiled"],
            "cached_tokens_after_move": after["cached_tokens"] - before["cached_tokens"],
            "pool_bytes": after["pool_bytes"], "memory_bytes": after["memory_bytes"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace")
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--preset", default=None)
    ap.add_argument("--state-bytes", type=int, default=26_800_000)
    ap.add_argument("--kv-bytes-per-token", type=int, default=65_526)
    ap.add_argument("--requests", type=int, default=0, help="the first N requests (0: all)")
    ap.add_argument("--device-cost", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    result: dict[str, Any] = {}
    if args.trace:
        records = load_trace(args.trace)
        if args.requests:
            records = records[:args.requests]
        sets = {"cache.memory_bytes": int(args.gib * 2**30), "cache.num_kv_tokens": 0,
                "cache.num_mamba_slots": 0}
        if args.preset:
            sets["model.preset"] = args.preset
        else:
            sets.update({"cache.state_bytes": args.state_bytes,
                         "cache.kv_bytes_per_token": args.kv_bytes_per_token})
        result["hit_rates"] = hit_rates(records, EngineConfig().replace(**sets),
                                        args.concurrency)
    if args.device_cost:
        result["device_cost"] = device_cost()
        print("device_cost", json.dumps(result["device_cost"]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
