"""Hit tokens, snapshot counters and steps of six simulator replays, exact (issue 23: a host-path
change must leave them equal to the token). Run it in two checkouts and compare the lines:

    python scripts/hit_tokens.py [--tree /path/to/other/checkout]

The replays go through ``mambacache.bench.simulate.simulate`` (the engine on the shadow runner):
the shared-prefix trace (600 requests, 16 prefixes of 512 tokens + 64, 16 output tokens) at
concurrency 1 and 16, with 48 slots, at page size 16 with 20k KV tokens; synthetic chat with
checkpoints every 64 tokens under ``flop_aware``; agent sessions at page size 4. ``--tree``: import
``mambacache`` from that checkout instead of this one (public API only: runs on older trees).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", default=str(Path(__file__).resolve().parents[1]))
    args = ap.parse_args(argv)
    sys.path.insert(0, args.tree)
    from mambacache.bench.simulate import shared_prefix_trace, simulate
    from mambacache.bench.traces import agent_trace, synthetic_chat_trace
    from mambacache.config import EngineConfig

    def cfg(**sets):
        return EngineConfig.load(None, overrides={"cache.num_kv_tokens": 200_000,
                                                  "cache.num_mamba_slots": 256, **sets})

    gsp = shared_prefix_trace(600, 16, 512, 64, output_len=16, seed=0)
    runs = [
        ("shared prefix, c1", gsp, cfg(), 1),
        ("shared prefix, c16", gsp, cfg(), 16),
        ("shared prefix, c16, 48 slots", gsp, cfg(**{"cache.num_mamba_slots": 48}), 16),
        ("shared prefix, c8, page 16, 20k KV, 64 slots", gsp,
         cfg(**{"cache.page_size": 16, "cache.num_kv_tokens": 20_000,
                "cache.num_mamba_slots": 64}), 8),
        ("chat 60 sessions, c8, checkpoints 64, flop_aware, 30k KV, 40 slots",
         synthetic_chat_trace(60, seed=1),
         cfg(**{"cache.checkpoint_interval": 64, "cache.eviction": "flop_aware",
                "cache.num_kv_tokens": 30_000, "cache.num_mamba_slots": 40}), 8),
        ("agent 20 sessions, c4, page 4, 60k KV, 48 slots", agent_trace(20),
         cfg(**{"cache.page_size": 4, "cache.num_kv_tokens": 60_000,
                "cache.num_mamba_slots": 48}), 4),
    ]
    keys = ("cached_tokens", "prompt_tokens", "snapshots_kept", "snapshots_skipped",
            "snapshots_evicted", "steps")
    for name, trace, c, k in runs:
        res = simulate(trace, c, concurrency=k)
        print(f"{name}: " + ", ".join(f"{key} {res.get(key)}" for key in keys), flush=True)


if __name__ == "__main__":
    main()
