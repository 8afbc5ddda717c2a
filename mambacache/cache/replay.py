"""Host-only replay of requests through a cache: the request lifecycle without a model.

``replay(cache, requests)`` drives each request as the engine does: ``match_prefix`` -> ``lock``
-> running slot + KV pages (``alloc_*``, evicting under pressure) -> ``plan_snapshots`` +
``assign_snapshot_slots`` -> at its finish ``insert`` (the tokens the model processed, the
planned snapshots, the running slot as the end snapshot when aligned) -> ``unlock``; with a host
tier (``cache/host_tier.py``), ``promote`` before the match. Up to ``concurrency`` requests are
in flight, admitted in order, the oldest finishing first; a request that does not fit waits for
it, one that can never fit is dropped and counted. With a byte budget, the engine's admission
back-pressure holds too (``ByteBudget.admits``: while others run, a request starts only if the
running requests' own bytes stay within the budget's ``running_share``); a request allocates all
its pages at admission here, so they count then.

A request is ``(prompt, tokens)``: ``int32`` arrays, ``tokens`` = prompt + output[:-1] (the last
sampled token is never fed to the model). Used by the ``flop_aware`` tuner's shadow caches
(``tuning.py``) and the per-budget table (``mambacache/bench/baselines.py``).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

import numpy as np

from mambacache.cache.snapshot_plan import (
    assign_snapshot_slots,
    end_snapshot_is_running_state,
    end_snapshot_position,
    plan_snapshots,
)

if TYPE_CHECKING:
    from mambacache.cache.radix import MambaRadixCache


def _admit(cache: MambaRadixCache, prompt: np.ndarray, tokens: np.ndarray, checkpoint_interval: int,
           running_bytes: int | None = None):
    """Match, lock, running slot, pages, planned snapshots; None if the pools are short, or
    (``running_bytes`` of requests in flight given) the budget's admission cap holds it back."""
    ps = cache.page_size
    tier = cache.host_tier
    gained = tier.promote(prompt) if tier is not None else 0  # deeper host-resident states
    m = cache.match_prefix(prompt)
    num_pages = -(-len(tokens) // ps) - m.cached_len // ps
    budget = getattr(cache, "budget", None)
    if running_bytes is not None and budget is not None \
            and not budget.admits(running_bytes, budget.request_bytes(num_pages)):
        return None
    cache.lock(m.node)
    slot = cache.alloc_slots(1)
    pages = cache.alloc_pages(num_pages) if slot is not None else None
    if pages is None:
        if slot is not None:
            cache.free_slots(slot)
        cache.unlock(m.node)
        return None
    pos = plan_snapshots(len(prompt), m.cached_len, m.branch_len, ps, checkpoint_interval)
    snaps = assign_snapshot_slots(cache, pos, m.branch_len, len(prompt), ps)
    if gained:
        tier.count_hit(min(gained, m.cached_len))
    all_pages = np.concatenate([m.page_ids, pages]) if len(m.page_ids) else pages
    return m, int(slot[0]), all_pages, snaps


def _finish(cache: MambaRadixCache, tokens: np.ndarray, m: Any, slot: int, pages: np.ndarray,
            snaps: dict[int, int]) -> None:
    total = len(tokens) + 1
    if end_snapshot_is_running_state(total, cache.page_size):
        snaps.setdefault(end_snapshot_position(total, cache.page_size), slot)
    if slot not in snaps.values():
        cache.free_slots([slot])
    cache.insert(tokens, pages, snaps)
    cache.unlock(m.node)


def replay(cache: MambaRadixCache, requests: list[tuple[np.ndarray, np.ndarray]],
           checkpoint_interval: int = 0, concurrency: int = 1,
           scored_from: int = 0) -> dict[str, int]:
    """Run ``requests`` through ``cache``; ``{"prompt_tokens", "cached_tokens", "dropped"}``
    counted over ``requests[scored_from:]`` (the ones before only warm the cache up); with a
    host tier (``cache.host_tier``) also ``host_hit_tokens`` (promoted, over all requests)."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    budget = getattr(cache, "budget", None)
    queue, running = deque(enumerate(requests)), deque()
    out = {"prompt_tokens": 0, "cached_tokens": 0, "dropped": 0}
    running_bytes = 0  # own pages + running slots of the requests in flight (with a budget)
    while queue or running:
        while queue and len(running) < concurrency:
            i, (prompt, tokens) = queue[0]
            got = _admit(cache, prompt, tokens, checkpoint_interval,
                         running_bytes if running else None)
            if got is None and running:
                break
            queue.popleft()
            if got is None:
                out["dropped"] += i >= scored_from
                continue
            own = budget.request_bytes(len(got[2]) - len(got[0].page_ids)) if budget else 0
            running_bytes += own
            running.append((own, tokens, *got))
            if i >= scored_from:
                out["prompt_tokens"] += len(prompt)
                out["cached_tokens"] += got[0].cached_len
        if running:
            own, tokens, m, slot, pages, snaps = running.popleft()
            running_bytes -= own
            _finish(cache, tokens, m, slot, pages, snaps)
    if cache.host_tier is not None:
        out["host_hit_tokens"] = cache.host_tier.counters["host_hit_tokens"]
    return out


def as_requests(records: list[dict[str, list[int]]]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Trace records ``{"prompt": [...], "output": [...]}`` as ``(prompt, tokens)`` pairs."""
    out = []
    for r in records:
        prompt = np.asarray(r["prompt"], dtype=np.int32)
        output = np.asarray(r["output"], dtype=np.int32)
        out.append((prompt, np.concatenate([prompt, output[:-1]]) if len(output) > 1 else prompt))
    return out
