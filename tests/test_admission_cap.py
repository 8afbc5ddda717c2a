"""Admission back-pressure over one byte budget (``cache.running_share``): while requests run,
another starts only if the running requests' own bytes stay within that share of the budget; the
replay (``cache/replay.py``) and the engine's scheduler apply the same rule."""

from __future__ import annotations

import numpy as np
import pytest
from shadow_helpers import SHADOW_BASE, greedy

import mambacache as mc
from mambacache.cache.budget import ByteBudget
from mambacache.cache.radix import make_cache
from mambacache.cache.replay import replay
from mambacache.config import CacheConfig
from mambacache.engine.engine import Engine
from mambacache.engine.runners.pools import size_pools
from mambacache.engine.shadow.runner import ShadowRunner

PAGE_B, SLOT_B = 10, 40  # page size 1: a state = the KV of 4 tokens


def test_admits_counts_own_pages_and_the_running_slot():
    b = ByteBudget(1000, PAGE_B, SLOT_B, running_share=0.5)
    assert b.request_bytes(20) == 240
    assert b.admits(240, 260) and not b.admits(240, 270)  # 500 = half the budget
    assert ByteBudget(1000, PAGE_B, SLOT_B).admits(900, 100)  # 1.0: no cap
    with pytest.raises(ValueError, match="running_share must be in"):
        ByteBudget(1000, PAGE_B, SLOT_B, running_share=0.0)
    with pytest.raises(ValueError, match="cache.running_share must be in"):
        CacheConfig(running_share=1.5)


def _disjoint(n: int, length: int) -> list[tuple[np.ndarray, np.ndarray]]:
    out = []
    for i in range(n):
        prompt = np.arange(1, length + 1, dtype=np.int32) + 1000 * i
        out.append((prompt, np.append(prompt, [7, 8]).astype(np.int32)))
    return out


class _Counting:
    """Wraps a budget cache's allocators to record the most requests holding a running slot."""

    def __init__(self, cache):
        self.cache, self.most, self.live = cache, 0, 0
        alloc, free, insert = cache.alloc_slots, cache.free_slots, cache.insert
        cache.alloc_slots = self._alloc(alloc)
        cache.free_slots, cache.insert = free, self._insert(insert)

    def _alloc(self, alloc):
        def run(n):
            got = alloc(n)
            if got is not None:
                self.live += 1
                self.most = max(self.most, self.live)
            return got
        return run

    def _insert(self, insert):
        def run(*args, **kw):
            self.live -= 1
            return insert(*args, **kw)
        return run


@pytest.mark.parametrize("share, together", [(1.0, 3), (0.5, 1)])
def test_replay_holds_back_while_the_running_bytes_pass_the_share(share, together):
    """Three disjoint 31-token requests (310 + 40 bytes each, no snapshots) in a 1200-byte
    budget, three in flight allowed: all three run together without a cap; at 0.5 (600 bytes)
    a second never joins the first, yet every one runs (nothing running never blocks)."""
    b = ByteBudget(1200, PAGE_B, SLOT_B, running_share=share)
    cache = make_cache(True, b.num_pages, b.num_slots, 1, speculative_states=False, budget=b)
    seen = _Counting(cache)
    out = replay(cache, _disjoint(3, 29), concurrency=3)
    assert out["dropped"] == 0 and out["prompt_tokens"] == 87
    assert seen.most == together
    cache.check_integrity()


def _budget_engine(share: float):
    """A shadow engine on a 3,000-byte budget (a 60-token request holds 600 bytes of KV and a
    40-byte slot), pools sized for a 200-token context as the simulator sizes them."""
    cfg = mc.EngineConfig().replace(**{
        **SHADOW_BASE, "cache.num_kv_tokens": 0, "cache.num_mamba_slots": 0,
        "cache.memory_bytes": 3000, "cache.state_bytes": SLOT_B,
        "cache.kv_bytes_per_token": PAGE_B, "cache.running_share": share})
    cfg = size_pools(cfg, None, context_len=200)[0]
    return Engine(cfg, runner=ShadowRunner.for_config(cfg, context_len=200))


def _most_running(engine, prompts, n) -> tuple[int, list]:
    ids = [engine.add_request(p, greedy(n)) for p in prompts]
    most, outs = 0, {}
    while engine.has_unfinished():
        for o in engine.step():  # finished requests only
            outs[o.request_id] = o.output_token_ids
        most = max(most, len(engine.scheduler.running))
    return most, [outs[i] for i in ids]


@pytest.mark.parametrize("share, together", [(1.0, 3), (0.5, 2), (0.2, 1)])
def test_engine_admission_waits_for_the_running_share_and_stays_exact(share, together):
    """The engine applies the same rule at admission: three disjoint 60-token prompts run three,
    two or one at a time as the share allows (each holds 640 of the 3,000 bytes when admitted),
    every read checked by the shadow runner, the outputs the same at every share."""
    engine = _budget_engine(share)
    assert engine.cache.budget.running_share == share
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 1000, 60).tolist() for _ in range(3)]
    most, outs = _most_running(engine, prompts, 4)
    assert most == together
    assert outs == [engine.runner.expected_output(p, 4) for p in prompts]
    engine.check_integrity()


def test_a_request_alone_always_starts_and_one_that_never_fits_fails_at_add():
    """A request whose own bytes pass the share starts when nothing runs (no spin, no wait);
    one that can never run is a ValueError when it is added (the budget holds one request of
    the context: ``plan_pools``)."""
    engine = _budget_engine(0.2)
    rng = np.random.default_rng(1)
    prompt = rng.integers(1, 1000, 150).tolist()  # 1,540 bytes: past 0.2 (600), within 3,000
    most, outs = _most_running(engine, [prompt], 3)
    assert most == 1 and outs == [engine.runner.expected_output(prompt, 3)]
    with pytest.raises(ValueError, match="exceeds the context length 200"):
        engine.add_request(rng.integers(1, 1000, 400).tolist(), greedy(1))
