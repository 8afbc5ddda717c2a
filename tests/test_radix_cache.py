"""MambaRadixCache: match, insert, locks, eviction, pages, extra_key, integrity."""

from __future__ import annotations

import numpy as np
import pytest
from radix_helpers import finish, serve, start

from mambacache.cache.disabled import DisabledCache
from mambacache.cache.radix import MambaRadixCache, make_cache


def arr(*xs):
    return np.array(xs, dtype=np.int32)


def cache_with(num_pages=256, num_slots=32, page_size=1, eviction="lru"):
    return make_cache(True, num_pages=num_pages, num_slots=num_slots, page_size=page_size,
                      eviction=eviction)


def insert_seq(cache, tokens, snaps_at):
    """Insert ``tokens`` on fresh pages with fresh slots at ``snaps_at``."""
    ps = cache.page_size
    pages = cache.alloc_pages(-(-len(tokens) // ps))
    slots = cache.alloc_slots(len(snaps_at))
    res = cache.insert(np.asarray(tokens, np.int32), pages,
                       dict(zip(snaps_at, slots.tolist(), strict=True)))
    cache.check_integrity()
    return res, pages, slots


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_identical_prompts_hit_all_but_last_token(page_size):
    cache = cache_with(num_pages=4096 // page_size, page_size=page_size)
    prompt = np.arange(1, 1001, dtype=np.int32)
    assert serve(cache, prompt).cached_len == 0
    for _ in range(3):
        m = serve(cache, prompt)
        assert m.cached_len == 999 // page_size * page_size
        assert m.branch_len >= m.cached_len
        assert len(m.page_ids) == m.cached_len // page_size
        assert m.read_slot is not None


def test_match_returns_inserted_pages_and_slot():
    cache = cache_with()
    res, pages, slots = insert_seq(cache, [5, 6, 7, 8, 9, 10], [3, 6])
    assert res.accepted == (3, 6) and res.kept_len == 6
    m = cache.match_prefix(arr(5, 6, 7, 8, 9, 10, 11))
    assert m.cached_len == 6 and m.read_slot == int(slots[1])
    assert m.page_ids.tolist() == pages.tolist()
    m = cache.match_prefix(arr(5, 6, 7, 8, 9, 10))  # capped at len - 1: the state at 3
    assert m.cached_len == 3 and m.read_slot == int(slots[0]) and m.branch_len == 6
    m = cache.match_prefix(arr(5, 6, 7, 1, 2))
    assert (m.cached_len, m.branch_len) == (3, 3)
    m = cache.match_prefix(arr(5, 6, 1))
    assert (m.cached_len, m.read_slot, m.branch_len) == (0, None, 2)
    assert len(m.page_ids) == 0
    assert cache.match_prefix(arr(5)).cached_len == 0


def test_match_is_read_only_and_refreshes_only_the_used_node():
    cache = cache_with()
    insert_seq(cache, [1, 2, 3, 4, 5, 6, 7, 8], [2, 4, 8])
    insert_seq(cache, [9, 9, 9], [3])
    nodes_before = list(cache.lru_all)
    states_before = list(cache.lru_state)
    m = cache.match_prefix(arr(1, 2, 3, 4, 5, 6, 1))  # leaves the tree mid-edge, uses state at 4
    assert m.cached_len == 4 and m.branch_len == 6
    assert len(cache.lru_all) == len(nodes_before)  # no split on match
    assert list(cache.lru_all)[-1] is m.node and list(cache.lru_state)[-1] is m.node
    rest = [n for n in nodes_before if n is not m.node]
    assert [n for n in cache.lru_all if n is not m.node] == rest  # nothing else moved
    assert [n for n in cache.lru_state if n is not m.node] == [
        n for n in states_before if n is not m.node]
    cache.check_integrity()


def test_insert_splits_edge_and_keeps_locked_node_identity():
    cache = cache_with()
    res, _, _ = insert_seq(cache, [1, 2, 3, 4, 5, 6], [6])
    leaf = res.node
    m = cache.match_prefix(arr(1, 2, 3, 4, 5, 6, 7))
    cache.lock(m.node)
    res2, _, _ = insert_seq(cache, [1, 2, 3, 8, 8], [3, 5])
    assert res2.accepted == (3, 5)
    assert leaf.alive and leaf.depth == 6 and len(leaf.key) == 3  # split above it
    assert leaf.parent.depth == 3 and leaf.parent.slot is not None
    assert leaf.parent.full_lock_ref == 1 and leaf.parent.mamba_lock_ref == 0
    cache.check_integrity()
    cache.unlock(m.node)
    cache.check_integrity()


def test_duplicate_kv_is_freed_and_tree_pages_returned():
    cache = cache_with(num_pages=64)
    res1, pages1, _ = insert_seq(cache, [1, 2, 3, 4], [4])
    free_before = cache.pages.num_free
    res2, pages2, _ = insert_seq(cache, [1, 2, 3, 4, 5, 6], [6])
    assert res2.freed_pages == 4 and res2.new_pages == 2
    assert res2.page_ids.tolist() == pages1.tolist() + pages2[4:].tolist()
    assert cache.pages.num_free == free_before - 2
    assert res1.kept_len == 4 and res2.kept_len == 6


def test_rejected_snapshots_are_freed():
    cache = cache_with(page_size=4)
    res, _, _ = insert_seq(cache, list(range(1, 13)), [8])
    slots_free = cache.slots.num_free
    pages = cache.alloc_pages(4)
    slots = cache.alloc_slots(5)
    tokens = np.arange(1, 15, dtype=np.int32)  # 14 tokens: 3 whole pages + a partial one
    snaps = {6: slots[0], 8: slots[1], 16: slots[2], 0: slots[3], 12: slots[4]}
    res = cache.insert(tokens, pages, {k: int(v) for k, v in snaps.items()})
    assert res.accepted == (12,)
    assert res.rejected == (0, 6, 8, 16)  # root, unaligned, already has a state, beyond
    assert cache.slots.num_free == slots_free - 1
    assert res.kept_len == 12 and res.new_pages == 1 and res.freed_pages == 3
    cache.check_integrity()


def test_kv_past_the_last_state_is_freed():
    cache = cache_with(num_pages=32)
    res, _, _ = insert_seq(cache, list(range(1, 11)), [6])
    assert res.kept_len == 6 and res.freed_pages == 4 and cache.pages.num_tree == 6
    res, _, _ = insert_seq(cache, list(range(20, 25)), [])  # no state at all: nothing kept
    assert res.kept_len == 0 and res.node.parent is None and cache.pages.num_tree == 6


def test_tombstone_is_healed():
    cache = cache_with()
    res, _, _ = insert_seq(cache, [1, 2, 3, 4, 5, 6], [3, 6])
    mid = res.node.parent
    assert mid.slot is not None and mid.depth == 3
    cache.lock(res.node)
    assert cache.evict_slots(1) == 1  # the only unlocked state: mid's state goes
    assert not mid.alive and res.node.depth == 6 and len(res.node.key) == 6  # folded into it
    assert cache.match_prefix(arr(1, 2, 3, 4)).cached_len == 0
    res2, _, _ = insert_seq(cache, [1, 2, 3], [3])
    assert res2.accepted == (3,) and res2.node.depth == 3 and res2.node.slot is not None
    assert res.node.parent is res2.node  # the edge split again where the state went back
    assert cache.match_prefix(arr(1, 2, 3, 4)).cached_len == 3
    cache.unlock(res.node)
    cache.check_integrity()


def test_locks_protect_path_and_state():
    cache = cache_with(num_pages=32, num_slots=8)
    res, _, _ = insert_seq(cache, [1, 2, 3, 4, 5, 6], [3, 6])
    insert_seq(cache, [7, 8], [2])
    m = cache.match_prefix(arr(1, 2, 3, 4, 5, 6, 9))
    cache.lock(m.node)
    assert m.node.full_lock_ref >= m.node.mamba_lock_ref == 1
    s = cache.stats()
    assert s["pages_protected"] == 6 and s["slots_protected"] == 1
    assert s["pages_evictable"] == 2 and s["slots_evictable"] == 2
    cache.evict_pages(100)
    cache.evict_slots(100)
    assert cache.match_prefix(arr(1, 2, 3, 4, 5, 6, 9)).cached_len == 6  # survived
    assert m.node.parent.slot is None  # unlocked state on the path went (tombstone)
    assert cache.match_prefix(arr(7, 8, 9)).cached_len == 0
    cache.check_integrity()
    cache.unlock(m.node)
    with pytest.raises(ValueError):
        cache.unlock(m.node)
    cache.evict_pages(100)
    assert cache.pages.num_tree == 0 and cache.slots.num_tree == 0
    cache.check_integrity()


def test_lock_of_tombstone_raises():
    cache = cache_with()
    res, _, _ = insert_seq(cache, [1, 2, 3, 4], [2, 4])
    mid = res.node.parent
    cache.lock(res.node)
    cache.evict_slots(1)
    with pytest.raises(ValueError):
        cache.lock(mid)
    cache.unlock(res.node)


def test_kv_eviction_removes_leaves_then_childless_tombstones():
    cache = cache_with(num_pages=32)
    insert_seq(cache, [1, 2, 3, 4], [2, 4])  # 1 2 | 3 4
    insert_seq(cache, [1, 2, 5, 6], [4])  # 1 2 | 5 6 (leaf)
    # drop the state at 2: tombstone with two children
    cache.lru_state.move_to_end(next(n for n in cache.lru_state if n.depth == 4 and n.key[0] == 3))
    victims = [n for n in cache.lru_state if n.depth == 2]
    cache._drop_state(victims[0])
    cache.check_integrity()
    freed = cache.evict_pages(4)  # both leaves go, then the childless tombstone
    assert freed == 6 and cache.pages.num_tree == 0 and len(cache.lru_all) == 0
    assert cache.stats()["pages_evicted"] == 6
    cache.check_integrity()


def test_state_eviction_internal_tombstone_leaf_whole():
    cache = cache_with(num_pages=32)
    res, _, _ = insert_seq(cache, [1, 2, 3, 4], [2, 4])
    leaf, mid = res.node, res.node.parent
    cache.lru_state.move_to_end(mid)  # leaf is now the least recent state
    assert cache.evict_slots(1) == 1
    assert not leaf.alive and mid.alive and mid.slot is not None
    assert cache.pages.num_tree == 2  # leaf's KV went with it
    assert cache.evict_slots(1) == 1
    assert cache.pages.num_tree == 0
    assert cache.stats()["snapshots_evicted"] == 2
    cache.check_integrity()


def test_alloc_evicts_then_returns_none():
    cache = cache_with(num_pages=8, num_slots=4)
    insert_seq(cache, list(range(1, 7)), [3, 6])
    pages = cache.alloc_pages(8)  # needs the tree's 6 pages
    assert pages is not None and cache.pages.num_tree == 0
    assert cache.alloc_pages(1) is None
    cache.free_pages(pages)
    cache.check_integrity()


def test_page_size_keys_compared_by_page():
    cache = cache_with(num_pages=64, page_size=4)
    insert_seq(cache, list(range(1, 13)), [4, 8, 12])
    m = cache.match_prefix(arr(1, 2, 3, 4, 5, 6, 7, 99, 9, 10, 11, 12, 13))
    assert (m.cached_len, m.branch_len) == (4, 4)  # page 2 differs in its last token
    m = cache.match_prefix(np.arange(1, 13, dtype=np.int32))
    assert m.cached_len == 8 and m.branch_len == 12
    res, _, _ = insert_seq(cache, [1, 2, 3, 4, 5, 6, 7, 99, 9, 10, 11, 12], [12])
    assert res.kept_len == 12 and res.new_pages == 2 and res.freed_pages == 1
    assert len(cache.roots[None].children) == 1


def test_extra_key_namespaces_the_tree():
    cache = cache_with()
    prompt = np.arange(1, 30, dtype=np.int32)
    serve(cache, prompt, extra_key="tenant-a")
    assert cache.match_prefix(prompt, extra_key="tenant-b").cached_len == 0
    assert cache.match_prefix(prompt).cached_len == 0
    assert cache.match_prefix(prompt, extra_key="tenant-a").cached_len == 28
    assert serve(cache, prompt, extra_key="tenant-a").cached_len == 28


def test_full_state_pool_all_locked_degrades():
    cache = cache_with(num_pages=512, num_slots=3)
    a, b = np.arange(1, 50, dtype=np.int32), np.arange(100, 140, dtype=np.int32)
    serve(cache, a)  # tree: states at 48 and 49
    r1 = start(cache, a)  # locks the state at 48, takes the last free slot
    assert r1 is not None and r1[0].cached_len == 48
    r2 = start(cache, b)  # running slot by evicting the state at 49; its snapshot is skipped
    assert r2 is not None and r2[2] == {}
    assert cache.stats()["snapshots_skipped"] == 1
    assert cache.available_slots() == 0
    assert start(cache, np.arange(200, 230, dtype=np.int32)) is None  # back-pressure, no raise
    assert cache.match_prefix(a).cached_len == 48  # match still works on a full pool
    finish(cache, b, [7], *r2)
    finish(cache, a, [7], *r1)
    cache.check_integrity()
    assert cache.match_prefix(np.concatenate([b, arr(1)])).cached_len == 40  # end snapshot
    assert cache.slots.num_held == 0 and cache.pages.num_held == 0


def test_mid_flight_insert_for_in_batch_dedup():
    cache = cache_with(num_pages=128)
    prompt = np.arange(1, 41, dtype=np.int32)
    m, run_slot, snaps = start(cache, prompt)
    own = cache.alloc_pages(40)
    snap = cache.alloc_slots(1)
    res = cache.insert(prompt[:32], own[:32], {32: int(snap[0])})
    assert res.kept_len == 32 and res.node.slot == int(snap[0])
    assert res.page_ids.tolist() == own[:32].tolist()
    cache.lock(res.node)
    cache.unlock(m.node)
    cache.check_integrity()
    m2 = cache.match_prefix(np.concatenate([prompt[:32], arr(99, 98)]))
    assert m2.cached_len == 32 and m2.read_slot == int(snap[0])
    # the first request finishes with its full page list (its first 32 pages are the tree's)
    pages = np.concatenate([res.page_ids, own[32:]])
    snaps = {**snaps, 40: run_slot}
    res2 = cache.insert(prompt, pages, snaps)
    assert res2.kept_len == 40 and res2.freed_pages == 0
    cache.unlock(res.node)
    cache.check_integrity()
    assert cache.slots.num_held == 0 and cache.pages.num_held == 0


def test_insert_bad_page_count_raises():
    cache = cache_with()
    with pytest.raises(ValueError, match="pages"):
        cache.insert(arr(1, 2, 3), arr(1, 2))


def test_check_integrity_catches_corruption():
    cache = cache_with()
    res, _, _ = insert_seq(cache, [1, 2, 3, 4], [2, 4])
    res.node.full_lock_ref = 1
    with pytest.raises(AssertionError, match="full_lock_ref"):
        cache.check_integrity()
    res.node.full_lock_ref = 0
    del cache.lru_state[res.node]
    with pytest.raises(AssertionError, match="lru_state"):
        cache.check_integrity()
    cache.lru_state[res.node] = None
    cache.check_integrity()
    leaked = cache.alloc_pages(1)
    cache.pages.adopt(leaked)  # TREE-owned but not in the tree
    with pytest.raises(AssertionError, match="not in the tree"):
        cache.check_integrity()


@pytest.mark.parametrize("eviction", ["lru", "flop_aware"])
def test_policies_keep_integrity_under_pressure(eviction):
    cache = cache_with(num_pages=200, num_slots=12, eviction=eviction)
    rng = np.random.default_rng(0)
    prefixes = [rng.integers(1, 50, 40) for _ in range(3)]
    for i in range(60):
        prompt = np.concatenate([prefixes[i % 3], rng.integers(1, 50, 10)])
        serve(cache, prompt.astype(np.int32))
    assert cache.stats()["snapshots_evicted"] > 0
    assert cache.match_prefix(np.concatenate([prefixes[0], arr(1, 2)])).cached_len == 40


def test_flop_aware_prefers_keeping_deep_states():
    cache = make_cache(True, 400, 8, eviction="flop_aware", alpha=2.0)
    deep, _, _ = insert_seq(cache, list(range(1, 301)), [300])  # older, but saves 300 tokens
    shallow, _, _ = insert_seq(cache, [500, 501], [2])
    cache.evict_slots(1)
    assert deep.node.alive and not shallow.node.alive
    lru = cache_with(num_pages=400, num_slots=8)
    deep, _, _ = insert_seq(lru, list(range(1, 301)), [300])
    shallow, _, _ = insert_seq(lru, [500, 501], [2])
    lru.evict_slots(1)
    assert not deep.node.alive and shallow.node.alive


def test_registry_and_disabled_cache():
    assert isinstance(make_cache(True, 8, 4), MambaRadixCache)
    cache = make_cache(False, num_pages=16, num_slots=4)
    assert isinstance(cache, DisabledCache)
    prompt = np.arange(1, 10, dtype=np.int32)
    for _ in range(2):
        m = serve(cache, prompt)
        assert m.cached_len == 0 and m.read_slot is None
    s = cache.stats()
    assert s["pages_free"] == 16 and s["slots_free"] == 4
    with pytest.raises(ValueError, match="eviction"):
        make_cache(True, 8, 4, eviction="nope")


def test_empty_namespaces_are_dropped():
    cache = cache_with()
    pages = cache.alloc_pages(3)
    cache.insert(arr(1, 2, 3), pages, {}, extra_key="t")  # nothing kept
    assert "t" not in cache.roots
    serve(cache, np.arange(1, 10, dtype=np.int32), extra_key="t")
    assert "t" in cache.roots
    cache.evict_pages(100)
    assert "t" not in cache.roots and None in cache.roots
    cache.check_integrity()
