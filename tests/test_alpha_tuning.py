"""flop_aware with alpha tuned online: alpha 0 is exactly LRU; the tuner replays the recent
window on shadows and moves away from recency only where that hits more."""

from __future__ import annotations

import numpy as np
import pytest

from mambacache.cache.radix import make_cache
from mambacache.cache.replay import as_requests, replay
from mambacache.cache.tuning import GRID, AlphaTuner


def _mixed(n_rounds: int, seed: int = 0):
    """A deep 300-token prompt every 6th request, one-off 12-token prompts in between."""
    rng = np.random.default_rng(seed)
    deep = rng.integers(1, 900, 300).tolist()
    reqs = []
    for _ in range(n_rounds):
        reqs.append({"prompt": deep + rng.integers(1, 900, 4).tolist(), "output": [5, 6]})
        reqs += [{"prompt": rng.integers(1, 900, 12).tolist(), "output": [5, 6]}
                 for _ in range(5)]
    return reqs


def _contents(cache):
    return sorted((n.depth, n.slot is not None) for n in cache.lru_all)


def test_alpha_zero_is_exactly_lru():
    reqs = as_requests(_mixed(12))
    lru = make_cache(True, 2000, 4, eviction="lru")
    zero = make_cache(True, 2000, 4, eviction="flop_aware", alpha=0.0)
    assert replay(lru, reqs) == replay(zero, reqs)
    assert _contents(lru) == _contents(zero)
    assert lru.stats()["snapshots_evicted"] > 0


def test_tuner_leaves_recency_where_deep_states_pay():
    reqs = as_requests(_mixed(60))
    lru = make_cache(True, 4000, 4, eviction="lru")
    auto = make_cache(True, 4000, 4, eviction="flop_aware", tune_window=60, tune_every=30)
    hit_lru = replay(lru, reqs)["cached_tokens"]
    hit_auto = replay(auto, reqs)["cached_tokens"]
    history = auto.policy.tuner.history
    assert len(history) >= 4 and all(alpha in GRID for _, alpha, _ in history)
    assert auto.policy.alpha > 0  # the deep prompt's state survives the one-off prompts
    assert hit_auto > 1.5 * hit_lru
    auto.check_integrity()


def test_tuner_stays_at_recency_without_a_clear_win():
    tuner = AlphaTuner(window=8, every=4, margin=0.05)
    cache = make_cache(True, 400, 8, eviction="flop_aware", alpha=0.0)
    for i in range(8):
        prompt = np.arange(1, 20, dtype=np.int32) + 20 * i
        tuner.record_match(prompt)
        tuner.record_insert(np.append(prompt, 7).astype(np.int32))
    assert len(tuner.requests) == 8 and not tuner.pending
    assert tuner.tune(cache) == GRID[0]  # nothing hits: every alpha ties, recency stays
    with pytest.raises(ValueError, match="grid"):
        AlphaTuner(grid=())


def test_tuner_counts_requests_in_flight_and_retries_once():
    tuner = AlphaTuner(window=8, every=100)
    prompts = [np.arange(1, 20, dtype=np.int32) + 20 * i for i in range(4)]
    for p in prompts:  # four admitted before any finishes
        tuner.record_match(p)
    # the same request matched again (pools short, or held back by the admission cap, retried
    # every step): counted once, so a held-back head neither advances the tuning clock nor
    # weighs on the in-flight median
    assert not tuner.record_match(prompts[-1])
    assert len(tuner.pending) == 4 and list(tuner.inflight) == [1, 2, 3, 4]
    assert tuner.matches == 4 and tuner.concurrency() == 2
    for p in prompts:
        tuner.record_insert(np.append(p, 7).astype(np.int32))
    assert not tuner.pending and len(tuner.requests) == 4


def test_tuner_without_a_clear_win_goes_back_to_recency_and_confirm_delays_a_switch():
    cache = make_cache(True, 400, 8, eviction="flop_aware", alpha=4.0)
    tuner = AlphaTuner(window=8, every=4, start=4.0)
    for i in range(8):
        prompt = np.arange(1, 20, dtype=np.int32) + 20 * i
        tuner.record_match(prompt)
        tuner.record_insert(np.append(prompt, 7).astype(np.int32))
    assert tuner.tune(cache) == GRID[0]  # every alpha ties: recency, the safe candidate
    reqs = as_requests(_mixed(60))
    slow = make_cache(True, 4000, 4, eviction="flop_aware", tune_window=60, tune_every=30,
                      tune_confirm=2)
    replay(slow, reqs)
    alphas = [a for _, a, _ in slow.policy.tuner.history]
    assert alphas[0] == GRID[0] and slow.policy.alpha > 0  # adopted at its second win
    with pytest.raises(ValueError, match="grid"):
        AlphaTuner(start=3.0)


def test_shadows_replay_with_the_requests_in_flight():
    reqs = as_requests(_mixed(40))
    cache = make_cache(True, 4000, 4, eviction="flop_aware", tune_window=60, tune_every=30)
    replay(cache, reqs, concurrency=4)
    assert cache.policy.tuner.concurrency() == 4
    cache.check_integrity()
