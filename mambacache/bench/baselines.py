"""Hit rate per memory budget: the defaults against a baseline and an oracle, on one trace.

    python -m mambacache.bench.baselines --trace chat.jsonl --budgets 1,2,5 [--concurrency 1] \\
        [--set cache.eviction=flop_aware] [--out table.json]

Three caches per budget, replayed host-only (``mambacache/cache/replay.py``: the request
lifecycle of the engine without a model, ``concurrency`` requests in flight, the oldest finishing
first):

* ``defaults``: ``CacheConfig()`` with the budget's pools (and the ``--set`` overrides);
* ``baseline``: LRU, states only at branch points and request ends
  (``speculative_states = false``, no checkpoints), the plain Marconi-admission tree;
* ``oracle``: attention-only: the same KV pool, and a state at every page boundary for free
  (``AttentionOracleCache``: a match is as long as the KV found in the tree), i.e. what a pure
  attention model's prefix cache would hit with this KV.

Budget mapping (``budget_pools``), a 7B hybrid: one state (conv + SSM, all linear layers) is
26.8 MB, the KV of 409 tokens (65.5 KB per token); half of the bytes go to states, half to KV.
1 GiB = 20 state slots + 8193 KV tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from mambacache.cache.node import MatchResult, as_tokens, path_pages
from mambacache.cache.radix import MambaRadixCache, make_cache_from_config
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


def _hit(res: dict[str, int]) -> float:
    return res["cached_tokens"] / res["prompt_tokens"] if res["prompt_tokens"] else 0.0


def budget_row(records: list[dict[str, list[int]]], gib: float, concurrency: int = 1,
               overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Hit rates of the defaults, the baseline and the oracle at one budget (trace records)."""
    requests = as_requests(records)
    kv, slots = budget_pools(gib)
    data = apply_overrides({"cache": {"num_kv_tokens": kv, "num_mamba_slots": slots}},
                           overrides or {})
    cfg = EngineConfig.from_dict(data).cache
    plain = dataclasses.replace(cfg, eviction="lru", checkpoint_interval=0,
                                speculative_states=False)
    defaults = replay(make_cache_from_config(cfg), requests, cfg.checkpoint_interval, concurrency)
    baseline = replay(make_cache_from_config(plain), requests, 0, concurrency)
    oracle = AttentionOracleCache(cfg.num_pages, oracle_slots(cfg, concurrency), cfg.page_size,
                                  speculative_states=False)
    best = replay(oracle, requests, 0, concurrency)
    return {"budget_gib": gib, "num_kv_tokens": kv, "num_mamba_slots": slots,
            "defaults": _hit(defaults), "baseline": _hit(baseline), "oracle": _hit(best),
            "dropped": defaults["dropped"], "config": dataclasses.asdict(cfg)}


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| budget | KV tokens | state slots | defaults | LRU, no speculative states | "
             "attention-only oracle |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['budget_gib']:g} GiB | {r['num_kv_tokens']} | {r['num_mamba_slots']} "
                     f"| {r['defaults']:.3f} | {r['baseline']:.3f} | {r['oracle']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(prog="python -m mambacache.bench.baselines", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", required=True)
    ap.add_argument("--budgets", default="1,2,5", help="GiB, comma separated")
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    with Path(args.trace).open() as f:
        requests = [json.loads(line) for line in f if line.strip()]
    overrides = parse_set_args(args.sets)
    rows = [budget_row(requests, float(g), args.concurrency, overrides)
            for g in args.budgets.split(",")]
    print(markdown(rows))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2) + "\n")
    return rows


if __name__ == "__main__":
    main()
