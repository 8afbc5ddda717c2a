"""The hit rate deterministic mode's prefill grid costs (issue 28), on the shadow runner:

    python scripts/deterministic_grid_hits.py --config configs/bench/multi_turn.toml
        [--set section.key=value ...] [--out result.json]

One pass of the config's workload through the engine on the shadow runner (no model, no
device; the scheduler and the cache as they run) per mode: deterministic with the references
(no grid: states kept at page boundaries, outputs inserted) and with the Pallas kernels (the
64-token grid: states at its multiples within a prompt, prompt tokens only). Prints the hit
rate, cached and computed prefill tokens of each, and the workload's ideal hit rate.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

KEYS = ("hit_rate", "ideal_hit_rate", "cached_tokens", "computed_prefill_tokens", "num_steps")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("--set", dest="sets", action="append", default=[])
    p.add_argument("--out")
    args = p.parse_args(argv)
    from mambacache.bench.cli import load_setup
    from mambacache.bench.runner import run_pass
    from mambacache.config import parse_set_args
    from mambacache.engine.engine import Engine, prefill_grid
    from mambacache.engine.shadow.runner import ShadowRunner

    setup = load_setup(args.config, parse_set_args(args.sets))
    out = {}
    for kernels in ("reference", "pallas"):
        cfg = setup.engine.replace(**{"model.deterministic": True, "model.kernels": kernels})
        engine = Engine(cfg, runner=ShadowRunner.for_config(cfg))
        source = setup.workload.source(engine.model_cfg.vocab_size, setup.bench.seed)
        stats = run_pass(engine, source, setup.bench)
        out[kernels] = {"grid": prefill_grid(cfg)} | {k: stats[k] for k in KEYS}
        print(f"{kernels:>9}: grid {out[kernels]['grid']:>2}  "
              + "  ".join(f"{k} {stats[k]:.3f}" if isinstance(stats[k], float)
                          else f"{k} {stats[k]}" for k in KEYS))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
