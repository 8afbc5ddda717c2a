"""Speculative states: the ``prompt_len - 1`` snapshot and checkpoints are kept while they pay.

They go before any branch point or request end under slot pressure, never push a firm state out
to get a slot, are promoted by a hit or a divergence, and ``check_integrity`` audits the
bookkeeping (``Node.spec``, ``lru_spec``, the marked slots).
"""

from __future__ import annotations

import numpy as np
import pytest
from radix_helpers import finish, serve, start

from mambacache.cache.radix import make_cache


def _seq(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(1, 1000, n).tolist()


def _node_at(cache, tokens):
    """The node ending exactly after ``tokens`` (or None)."""
    m = cache._walk(cache.roots[None], np.asarray(tokens, np.int32), len(tokens))
    path = m[0]
    return path[-1] if path and path[-1].depth == len(tokens) else None


def _states(cache) -> dict[int, bool]:
    """{depth: speculative} of every state in the tree."""
    return {n.depth: n.spec for n in cache.lru_state}


def test_last_but_one_is_speculative_end_is_firm():
    cache = make_cache(True, num_pages=256, num_slots=8)
    serve(cache, _seq(0, 20), output=(5, 6, 7))
    # prompt 20, output 3: prompt_len - 1 = 19 speculative, end 22 firm
    assert _states(cache) == {19: True, 22: False}
    assert cache.stats()["tree_speculative_states"] == 1


def test_slot_pressure_takes_speculative_states_before_older_firm_ones():
    cache = make_cache(True, num_pages=512, num_slots=6)
    a, b = _seq(1, 30), _seq(2, 30)
    serve(cache, a, output=(5, 6))  # oldest: a's end state and its prompt_len - 1
    serve(cache, b, output=(5, 6))
    assert sorted(_states(cache).items()) == [(29, True), (31, False)]  # same depths for a, b
    assert len(cache.lru_state) == 4 and len(cache.lru_spec) == 2
    cache.evict_slots(2)  # LRU would take a's two states; the speculative ones go instead
    cache.check_integrity()
    assert len(cache.lru_spec) == 0
    assert _node_at(cache, a + [5]).slot is not None and _node_at(cache, b + [5]).slot is not None
    # both conversations resume from their end states
    assert cache.match_prefix(a + [5, 6, 9]).cached_len == 31
    assert cache.match_prefix(b + [5, 6, 9]).cached_len == 31


def test_speculative_slot_never_evicts_a_firm_state():
    cache = make_cache(True, num_pages=512, num_slots=3)
    for seed in range(3):  # three end states fill the pool; the 2nd and 3rd prompt_len - 1 find
        serve(cache, _seq(10 + seed, 16), output=(5,))  # no slack (free + spec < held + 1)
    firm = set(cache.lru_state)
    assert len(firm) == 3 and not cache.lru_spec
    assert cache.stats()["snapshots_skipped"] == 2
    got = cache.alloc_speculative_slots(2)
    assert len(got) == 0 and set(cache.lru_state) == firm
    cache.check_integrity()


def test_speculative_slots_leave_room_for_the_slots_requests_hold():
    cache = make_cache(True, num_pages=64, num_slots=10)
    running = cache.alloc_slots(6)  # six requests run: the next admissions need about as many
    assert len(cache.alloc_speculative_slots(3)) == 0  # free 4 < held 6
    cache.free_slots(running[:4])
    got = cache.alloc_speculative_slots(3)  # free 8, held 2: 3 granted, 5 >= 2 left
    assert len(got) == 3 and cache.spec_slots == set(got.tolist())
    assert len(cache.alloc_speculative_slots(9)) == 0  # free 5, held 5: nothing to spare
    cache.free_slots(np.concatenate([running[4:], got]))
    cache.check_integrity()


def test_identical_prompt_hit_promotes_and_keeps_it():
    cache = make_cache(True, num_pages=512, num_slots=6)
    p, q = _seq(3, 40), _seq(4, 40)
    serve(cache, p, output=(5,))
    serve(cache, q, output=(5,))
    m = serve(cache, p, output=(5,))  # hits p's prompt_len - 1: promoted
    assert m.cached_len == 39
    assert _node_at(cache, p[:39]).spec is False
    assert _node_at(cache, q[:39]).spec is True
    assert cache.stats()["snapshots_promoted"] == 1
    cache.evict_slots(1)  # q's unproven state goes, p's proven one stays
    assert _node_at(cache, p[:39]).slot is not None
    assert _node_at(cache, q[:39]) is None or _node_at(cache, q[:39]).slot is None
    cache.check_integrity()


def test_divergence_at_a_speculative_state_promotes_it():
    cache = make_cache(True, num_pages=512, num_slots=8)
    base = _seq(5, 24)
    spec = cache.alloc_speculative_slots(1)
    firm = cache.alloc_slots(1)
    pages = cache.alloc_pages(24)
    cache.insert(base, pages, {12: int(spec[0]), 24: int(firm[0])})
    assert _node_at(cache, base[:12]).spec is True
    # a second sequence leaves the first exactly at 12 (a branch point there, not a hit)
    other = base[:12] + _seq(6, 10)
    slot = cache.alloc_slots(1)
    own = cache.alloc_pages(10)
    cache.insert(other, np.concatenate([pages[:12], own]), {22: int(slot[0])})
    assert _node_at(cache, base[:12]).spec is False
    cache.check_integrity()


def test_kv_eviction_goes_through_a_speculative_parent():
    cache = make_cache(True, num_pages=64, num_slots=8)
    serve(cache, _seq(7, 30), output=(5, 6))  # spec state at 29, end at 31
    assert cache.pages.num_tree == 31
    cache.evict_pages(1)  # the end leaf (2 pages): the speculative parent holds no KV on its own
    assert cache.pages.num_tree == 0 and not cache.lru_state and not cache.lru_spec
    cache.check_integrity()


def test_freed_and_rejected_speculative_slots_lose_their_mark():
    cache = make_cache(True, num_pages=64, num_slots=8)
    got = cache.alloc_speculative_slots(3)
    assert cache.spec_slots == set(got.tolist())
    cache.free_slots(got[:1])
    pages = cache.alloc_pages(8)
    # position 9 is past the tokens: rejected and freed; 4 accepted as speculative
    res = cache.insert(_seq(8, 8), pages, {4: int(got[1]), 9: int(got[2])})
    assert res.accepted == (4,) and res.rejected == (9,)
    assert not cache.spec_slots and cache.lru_spec
    cache.check_integrity()


def test_integrity_catches_broken_speculative_bookkeeping():
    cache = make_cache(True, num_pages=64, num_slots=8)
    serve(cache, _seq(9, 20), output=(5, 6))
    node = next(iter(cache.lru_spec))
    del cache.lru_spec[node]
    with pytest.raises(AssertionError, match="lru_spec"):
        cache.check_integrity()
    cache.lru_spec[node] = None
    cache.check_integrity()
    cache.spec_slots.add(int(cache.slots._stack[0]))  # a free slot marked speculative
    with pytest.raises(AssertionError, match="marked speculative"):
        cache.check_integrity()
    cache.spec_slots.clear()
    cache.check_integrity()
    serve(cache, _seq(9, 10) + [1, 2], output=(5,))  # node 10 becomes a branch point
    branch = _node_at(cache, _seq(9, 10))
    assert len(branch.children) == 2 and branch.slot is not None
    cache._drop_state(branch)
    branch.spec = True  # a speculative tombstone
    with pytest.raises(AssertionError, match="speculative without a state"):
        cache.check_integrity()
    branch.spec = False
    cache.check_integrity()


def test_dropped_state_folds_its_node_into_the_only_child():
    cache = make_cache(True, num_pages=64, num_slots=8)
    p = _seq(13, 20)
    serve(cache, p, output=(5, 6))  # speculative state at 19, end at 21
    spec = _node_at(cache, p[:19])
    end = next(iter(spec.children.values()))
    assert cache.evict_slots(1) == 1  # the speculative one
    assert not spec.alive and end.alive and end.parent.parent is None
    assert end.depth == 21 and len(end.key) == 21 and len(end.pages) == 21
    assert cache.match_prefix(p + [5, 6]).cached_len == 21
    cache.check_integrity()


@pytest.mark.parametrize("page_size", [1, 16])
def test_states_only_at_branch_points_and_ends_when_off(page_size):
    """``speculative_states=False`` (the baseline): identical prompts never hit, and the prompt
    diverging from a cached one plans its branch point only."""
    prompt = _seq(10, 300)
    for spec, hit in ((True, 299 // page_size * page_size), (False, 0)):
        cache = make_cache(True, num_pages=1024, num_slots=8, page_size=page_size,
                           speculative_states=spec)
        hits = [serve(cache, prompt, output=(5,)).cached_len for _ in range(4)]
        assert hits == [0, hit, hit, hit]
        assert cache.stats()["snapshots_skipped"] == 0
    cache = make_cache(True, num_pages=512, num_slots=8, speculative_states=False)
    p = _seq(11, 40)
    serve(cache, p, output=(5,), checkpoint_interval=8)  # checkpoints are speculative too
    assert list(_states(cache)) == [40]
    m, slot, snaps = start(cache, p[:20] + _seq(12, 10))
    assert list(snaps) == [20]  # the branch point only
    finish(cache, p[:20] + _seq(12, 10), [5], m, slot, snaps)
    assert _states(cache) == {20: False, 30: False, 40: False}
    cache.check_integrity()


def test_config_reaches_the_cache():
    from mambacache.cache.from_config import make_cache_from_config
    from mambacache.config import CacheConfig

    assert CacheConfig().checkpoint_interval == 256 and CacheConfig().speculative_states
    assert make_cache_from_config(CacheConfig()).speculative_states is True
    assert make_cache_from_config(CacheConfig(speculative_states=False)).speculative_states is False
    with pytest.raises(ValueError, match="speculative_states"):
        CacheConfig(speculative_states="yes")
