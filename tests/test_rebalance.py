"""The moving device split on the host: the allocators' id limit, eviction above it, the splits
and the tuner's choice (``cache/rebalance.py``; the engine's moves are fuzzed in
``test_engine_fuzz.py`` and run on the tiny model in ``test_memory_budget.py``)."""

from __future__ import annotations

import numpy as np
import pytest

from mambacache.cache.allocator import FENCED, FREE, HELD, IdAllocator
from mambacache.cache.budget import ByteBudget
from mambacache.cache.radix import make_cache
from mambacache.cache.rebalance import SplitTuner, device_splits


def test_id_limit_fences_free_ids_and_ids_given_back_above_it():
    a = IdAllocator(10, "slot")
    a.alloc(8)  # ids 1..8
    a.free([7, 8])
    a.set_limit(5)
    assert a.in_use_above_limit() == 1 and a.num_fenced == 4  # 6 held; 7, 8, 9, 10 fenced
    assert a.alloc(1) is None  # 1..5 held: nothing below the limit is free
    a.free([6])
    assert a.status_of(np.asarray([6]))[0] == FENCED and a.in_use_above_limit() == 0
    a.check()
    a.free([2])
    assert a.alloc(1).tolist() == [2]  # only ids below the limit come back
    a.set_limit(8)  # raised: 6, 7, 8 are free again, 9 and 10 stay fenced
    assert set(a.status_of(np.asarray([6, 7, 8])).tolist()) == {FREE} and a.num_fenced == 2
    assert a.status_of(np.asarray([1]))[0] == HELD
    a.check()
    with pytest.raises(ValueError, match="limit must be in"):
        a.set_limit(11)


def test_evict_above_drops_unlocked_entries_past_the_limits_only():
    b = ByteBudget(10_000, 10, 40)
    cache = make_cache(True, 40, 12, 1, budget=b)
    for first in (1, 2, 3):  # three paths of 8 tokens with a state at their end
        pages, slots = cache.alloc_pages(8), cache.alloc_slots(1)
        cache.insert(list(range(first * 100, first * 100 + 8)), pages, {8: int(slots[0])})
    m = cache.match_prefix(list(range(100, 109)))
    cache.lock(m.node)  # the first path (pages 1..8, slot 1) is in use
    cache.pages.set_limit(12)
    cache.slots.set_limit(1)
    cache.evict_above(12, 1)  # the second path (pages 9..16, slot 2) and the third go
    assert cache.pages.in_use_above_limit() == 0 and cache.slots.in_use_above_limit() == 0
    assert cache.match_prefix(list(range(200, 209))).cached_len == 0
    cache.unlock(m.node)
    cache.check_integrity()
    assert cache.match_prefix(list(range(100, 109))).cached_len == 8


def test_device_splits_keep_the_formula_and_the_minimums():
    splits, base = device_splits(100_000, 100, 1_000, 0.3, min_pages=300, min_slots=8)
    assert splits[base] == (700, 30)  # 0.3 to states
    assert [s for _, s in splits] == sorted(s for _, s in splits) and len(splits) == 3
    assert all(p * 100 + s * 1_000 <= 100_000 and p >= 300 and s >= 8 for p, s in splits)
    few, base = device_splits(100_000, 100, 1_000, 0.3, min_pages=600, min_slots=8)
    assert few == ((850, 15), (700, 30)) and base == 1  # 0.45 leaves too few pages


def test_split_tuner_moves_toward_the_pool_whose_evictions_cost_hits():
    """Sixteen chat sessions in turn, each turn extending the last: two slots lose every end
    state before its session comes back, twenty keep them; the tuner picks the neighbour with
    more slots, only after winning twice (hysteresis)."""
    rng = np.random.default_rng(0)
    history = [rng.integers(0, 500, 24).astype(np.int32) for _ in range(16)]
    b = ByteBudget(100_000, 1, 100)
    cache = make_cache(True, 5_000, 40, 1, "lru", budget=b)
    tuner = SplitTuner(window=32, every=16, margin=0.02, confirm=2)
    for i in range(48):
        prompt = np.concatenate([history[i % 16], rng.integers(0, 500, 4).astype(np.int32)])
        tuner.record_match(prompt)
        tuner.record_insert(np.append(prompt, np.int32(7)))  # the model saw one output token
        history[i % 16] = np.concatenate([prompt, np.asarray([7, 7], np.int32)])
    splits = ((4_000, 2), (3_000, 20))
    assert tuner.tune(cache, splits, 0) == 0  # one win is not a move
    assert tuner.tune(cache, splits, 0) == 1
    hits = tuner.history[-1][2]
    assert hits[1] > 2 * hits[0]
    assert tuner.tune(cache, splits, 1) == 1  # at the better split: stay


def test_rows_dropped_by_a_move_and_grown_back_are_rewritten_before_they_are_read():
    """The role-change case on the shadow runner (every read checked against its prefix): slot
    and page rows above the small split hold states and KV, the split shrinks (their entries
    evicted, the rows forgotten), grows back (new rows hold nothing), and requests use those
    ids again: outputs are the oracle's, rows past the small split hold new prefixes."""
    from shadow_helpers import greedy, shadow_engine

    eng = shadow_engine(**{"cache.memory_bytes": 40 * 4 + 40 * 1, "cache.state_bytes": 4,
                           "cache.kv_bytes_per_token": 1, "cache.rebalance": True,
                           "cache.device_splits": ((160, 6), (80, 26)),
                           "cache.num_kv_tokens": 80, "cache.num_mamba_slots": 26,
                           "scheduler.max_running_requests": 2})
    rb, runner = eng.rebalancer, eng.runner
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, 900, 20).tolist() for _ in range(12)]
    outs = eng.generate(prompts[:6], greedy(3))
    assert (runner.slot_len[7:] > 0).any()  # states past the small split's slots
    rb.move_now(0)  # slots 7.. dropped, pages up to 160
    assert len(runner.slot_len) == 7 and eng.cache.slots.in_use_above_limit() == 0
    outs += eng.generate(prompts[6:], greedy(3))
    assert (runner.kv_len[81:] > 0).any()  # KV in rows that were past the other split
    rb.move_now(1)  # pages 81.. dropped, slots 7.. back as zeros
    assert not runner.slot_len[7:].any()
    outs += eng.generate(prompts, greedy(3))
    assert (runner.slot_len[7:] > 0).any()  # rewritten, then read by the checks
    for out, prompt in zip(outs, prompts + prompts, strict=True):
        assert out.output_token_ids == runner.expected_output(prompt, 3)
    assert eng.metrics()["split_moves"] == 2
    eng.check_integrity()
