"""Hit rate per memory budget: one shared byte budget against fixed splits, a baseline, an oracle.

    python -m mambacache.bench.baselines --trace chat.jsonl --budgets 1,2,5 [--concurrency 1] \
        [--preset qwen3_next_80b_a3b | --state-bytes B --kv-bytes-per-token B] \
        [--set cache.eviction=flop_aware] [--host-budgets 8 [--shared-only]] [--out table.json]

Caches per budget, replayed host-only (``mambacache/cache/replay.py``: the request lifecycle of
the engine without a model, ``concurrency`` requests in flight, the oldest finishing first):

* ``shared``: ``CacheConfig()`` with ``cache.memory_bytes`` = the budget and no split: KV pages
  and states draw on one byte budget (``cache/budget.py``), evicted in one order (``eviction =
  "auto"``: tuned ``flop_aware``), the engine's admission back-pressure on (``cache.running_share``
  0.5: while others run, a request starts only if the running requests' own bytes stay within
  half of the budget);
* ``defaults``: ``CacheConfig()`` with two fixed pools, half of the bytes to states (the table
  before the shared budget);
* ``best_split``: the same fixed pools at the best state share of 0.1, 0.2, ... 0.9
  (``split_share`` says which; ``splits`` has them all);
* ``lru_shared``: a plain LRU tree over one shared byte pool, states only at branch points and
  request ends, no admission cap (Marconi's "SGLang+" baseline);
* ``baseline``: LRU, states only at branch points and request ends, fixed pools split in half;
* ``host``: the shared budget with a host tier of each ``--host-budgets`` size behind it
  (``cache/host_tier.py``: device eviction demotes to host memory, a match promotes back);
* ``oracle``: attention-only: the KV of the half split, and a state at every page boundary for
  free (``AttentionOracleCache``: a match is as long as the KV found in the tree).

Hit rates are cached prompt tokens over ALL prompt tokens of the trace (a request that can never
fit a split counts as a miss). Byte mapping: by default a 7B hybrid (one state 26.8 MB = the KV
of 409 tokens, 65.5 KB per token); ``--preset`` takes a real-size preset's sizes in bf16
(``models/sizes.py``), ``--state-bytes`` / ``--kv-bytes-per-token`` any other model's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from mambacache.cache.budget import ByteBudget
from mambacache.cache.from_config import make_cache_from_config
from mambacache.cache.node import MatchResult, as_tokens, path_pages
from mambacache.cache.radix import MambaRadixCache
from mambacache.cache.replay import as_requests, replay
from mambacache.config import CacheConfig, EngineConfig, apply_overrides, parse_set_args

STATE_BYTES = 26.8e6  # one state of a 7B hybrid (conv + SSM of every linear layer)
STATE_KV_TOKENS = 409  # the same bytes as KV: 409 tokens


def budget_pools(gib: float, state_bytes: float = STATE_BYTES,
                 state_kv_tokens: float = STATE_KV_TOKENS,
                 state_share: float = 0.5) -> tuple[int, int]:
    """``(num_kv_tokens, num_mamba_slots)`` for ``gib`` GiB, ``state_share`` of it to states."""
    if gib <= 0 or not 0 < state_share < 1:
        raise ValueError(f"need a budget > 0 GiB and 0 < state_share < 1, got {gib}, "
                         f"{state_share}")
    total = gib * 2**30
    slots = int(total * state_share / state_bytes)
    kv = int(total * (1 - state_share) / (state_bytes / state_kv_tokens))
    if slots < 2:
        raise ValueError(f"{gib} GiB holds {slots} state slots; at least 2 are needed")
    return kv, slots


class AttentionOracleCache(MambaRadixCache):
    """The radix cache as if every page boundary held a state: ``match_prefix`` hits all of the
    prompt's KV found in the tree (up to ``len - 1``), making the state there for free. Give it
    enough slots that state eviction never happens (``oracle_slots``)."""

    def match_prefix(self, prompt_ids, extra_key: Any = None) -> MatchResult:
        tokens = as_tokens(prompt_ids)
        m = super().match_prefix(tokens, extra_key)
        ps = self.page_size
        hit = min(m.branch_len, (len(tokens) - 1) // ps * ps)
        if hit <= m.cached_len:
            return m
        root = self.roots[extra_key]
        node = self._nodes_ending_at(root, tokens, [hit])[0]
        slot = self.slots.alloc(1)
        if slot is None:
            raise ValueError(f"the oracle ran out of its {self.slots.num_ids} state slots")
        self.slots.adopt(slot)
        node.slot = int(slot[0])
        self.lru_state[node] = None
        self._touch(node)
        return MatchResult(hit, path_pages(node), node.slot, node, m.branch_len)


def oracle_slots(cfg: CacheConfig, concurrency: int) -> int:
    """Slots that can never run out: a state per node (at most 2 per KV page) + requests."""
    return 2 * cfg.num_pages + 4 * concurrency + 8


SHARES = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


def _config(gib: float, state_share: float | None, overrides: dict[str, Any],
            state_bytes: float, kv_bytes: float) -> CacheConfig:
    """The cache section at ``gib``: two fixed pools at ``state_share``, or (``None``) one
    shared byte budget (pool ids derived, ``cache/budget.ByteBudget``)."""
    if state_share is None:
        budget = ByteBudget(int(gib * 2**30), round(kv_bytes), round(state_bytes))
        cache = {"memory_bytes": budget.limit_bytes, "state_bytes": budget.slot_bytes,
                 "kv_bytes_per_token": budget.page_bytes, "num_kv_tokens": budget.num_pages,
                 "num_mamba_slots": budget.num_slots}
    else:
        kv, slots = budget_pools(gib, state_bytes, state_bytes / kv_bytes, state_share)
        cache = {"num_kv_tokens": kv, "num_mamba_slots": slots}
    return EngineConfig.from_dict(apply_overrides({"cache": cache}, overrides)).cache


def _run(cfg: CacheConfig, requests: list, concurrency: int, total: int) -> float:
    res = replay(make_cache_from_config(cfg), requests, cfg.checkpoint_interval, concurrency)
    return res["cached_tokens"] / total if total else 0.0


def budget_row(records: list[dict[str, list[int]]], gib: float, concurrency: int = 1,
               overrides: dict[str, Any] | None = None, state_bytes: float = STATE_BYTES,
               kv_bytes_per_token: float = STATE_BYTES / STATE_KV_TOKENS,
               host_gibs: tuple[float, ...] = (), shared_only: bool = False) -> dict[str, Any]:
    """Hit rates of the shared budget, the fixed splits, the baselines and the oracle at one
    budget (trace records); see the module docstring. ``host_gibs``: the shared budget with a
    host tier of each size behind it (``host``: {GiB: hit rate}); ``shared_only``: only the
    shared budget and those."""
    requests = as_requests(records)
    total = sum(len(p) for p, _ in requests)
    over = overrides or {}
    plain = {"eviction": "lru", "checkpoint_interval": 0, "speculative_states": False}

    def cfg(share, extra=None):
        return _config(gib, share, {**over, **(extra or {})}, state_bytes, kv_bytes_per_token)

    host = {h: _run(cfg(None, {"cache.host_memory_bytes": int(h * 2**30)}), requests,
                    concurrency, total) for h in host_gibs}
    if shared_only:
        return {"budget_gib": gib, "shared": _run(cfg(None), requests, concurrency, total),
                "host": host, "state_bytes": state_bytes,
                "kv_bytes_per_token": kv_bytes_per_token}
    half = cfg(0.5)
    splits = {}
    for share in SHARES:
        try:
            splits[share] = _run(cfg(share), requests, concurrency, total)
        except ValueError:  # fewer than 2 slots at this share
            continue
    best = max(splits, key=splits.__getitem__)
    oracle = AttentionOracleCache(half.num_pages, oracle_slots(half, concurrency),
                                  half.page_size, speculative_states=False)
    shared = cfg(None)
    return {"budget_gib": gib, "num_kv_tokens": half.num_kv_tokens,
            "num_mamba_slots": half.num_mamba_slots, "state_bytes": state_bytes,
            "kv_bytes_per_token": kv_bytes_per_token,
            "shared": _run(shared, requests, concurrency, total),
            "defaults": splits.get(0.5, 0.0), "best_split": splits[best], "split_share": best,
            "splits": splits,
            "lru_shared": _run(cfg(None, {f"cache.{k}": v
                                          for k, v in {**plain, "running_share": 1.0}.items()}),
                               requests, concurrency, total),
            "baseline": _run(dataclasses.replace(half, **plain), requests, concurrency, total),
            "oracle": replay(oracle, requests, 0, concurrency)["cached_tokens"] / total,
            "host": host, "config": dataclasses.asdict(shared)}


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| budget | shared budget | best fixed split (state share) | defaults (half) | "
             "LRU, one shared pool | LRU, no speculative states (half) | attention-only oracle |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['budget_gib']:g} GiB | {r['shared']:.3f} | {r['best_split']:.3f} "
                     f"({r['split_share']:g}) | {r['defaults']:.3f} | {r['lru_shared']:.3f} | "
                     f"{r['baseline']:.3f} | {r['oracle']:.3f} |")
    return "\n".join(lines)


def host_markdown(rows: list[dict[str, Any]]) -> str:
    """The shared budget alone and with each host tier, one line per device budget."""
    hosts = sorted({h for r in rows for h in r["host"]})
    lines = ["| device budget | device only | " + " | ".join(
        f"+ host {h:g} GiB" for h in hosts) + " |", "|---" * (2 + len(hosts)) + "|"]
    for r in rows:
        cells = " | ".join(f"{r['host'][h]:.3f}" if h in r["host"] else "" for h in hosts)
        lines.append(f"| {r['budget_gib']:g} GiB | {r['shared']:.3f} | {cells} |")
    return "\n".join(lines)


def preset_sizes(name: str) -> tuple[int, int]:
    """``(state_bytes, kv_bytes_per_token)`` of a model preset in bf16 (no parameters)."""
    import jax.numpy as jnp

    from models.presets import get_preset
    from models.sizes import kv_bytes_per_token, state_bytes_per_slot

    cfg = get_preset(name)
    return state_bytes_per_slot(cfg, jnp.bfloat16), kv_bytes_per_token(cfg, jnp.bfloat16)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(prog="python -m mambacache.bench.baselines", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", required=True)
    ap.add_argument("--budgets", default="1,2,5", help="GiB, comma separated")
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--preset", default=None, help="a model preset's byte sizes (bf16)")
    ap.add_argument("--state-bytes", type=float, default=STATE_BYTES)
    ap.add_argument("--kv-bytes-per-token", type=float, default=STATE_BYTES / STATE_KV_TOKENS)
    ap.add_argument("--host-budgets", default="", help="host tier GiB, comma separated: a "
                    "column each, the shared budget with that host tier behind it")
    ap.add_argument("--shared-only", action="store_true",
                    help="only the shared budget and the host columns (no splits, baselines)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    with Path(args.trace).open() as f:
        requests = [json.loads(line) for line in f if line.strip()]
    overrides = parse_set_args(args.sets)
    sizes = preset_sizes(args.preset) if args.preset else (args.state_bytes,
                                                           args.kv_bytes_per_token)
    hosts = tuple(float(h) for h in args.host_budgets.split(",") if h)
    rows = [budget_row(requests, float(g), args.concurrency, overrides, *sizes, host_gibs=hosts,
                       shared_only=args.shared_only) for g in args.budgets.split(",")]
    if not args.shared_only:
        print(markdown(rows))
    if hosts or args.shared_only:
        print(host_markdown(rows))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2) + "\n")
    return rows


if __name__ == "__main__":
    main()
