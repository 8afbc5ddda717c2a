"""Warm restarts of the tree alone (``cache/state.py``, host only): a dumped tree loads into a
fresh cache with the same states at the same paths, each firm or speculative as it was, the
same recency orders, and the same hits."""

from __future__ import annotations

import json

import numpy as np
from radix_helpers import serve

from mambacache.cache.radix import make_cache
from mambacache.cache.state import dump_tree, load_tree


def _seq(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(1, 1000, n).tolist()


def _states(cache) -> list[tuple[tuple[int, ...], bool]]:
    """(path tokens, speculative) of every state, least recently used first."""
    out = []
    for node in cache.lru_state:
        parts, walk = [], node
        while walk.parent is not None:
            parts.append(walk.key)
            walk = walk.parent
        out.append((tuple(np.concatenate(parts[::-1]).tolist()), node.spec))
    return out


def test_speculative_states_survive_a_restart():
    cache = make_cache(True, num_pages=512, num_slots=16)
    shared = _seq(0, 24)
    for i in range(4):  # prompt_len - 1 snapshots are speculative, request ends firm
        serve(cache, shared + _seq(i + 1, 9 + i), output=(5, 6))
    serve(cache, _seq(9, 30), output=(1,))
    before = _states(cache)
    assert any(spec for _, spec in before) and not all(spec for _, spec in before)
    tree = json.loads(json.dumps(dump_tree(cache)))  # what save_cache writes
    fresh = make_cache(True, num_pages=512, num_slots=16)
    load_tree(fresh, tree)
    fresh.check_integrity()
    after = _states(fresh)
    assert sorted(after) == sorted(before)
    assert [s for s in after if not s[1]] == [s for s in before if not s[1]]
    assert [s for s in after if s[1]] == [s for s in before if s[1]]
    assert [n.depth for n in fresh.lru_spec] == [n.depth for n in cache.lru_spec]
    for probe in (shared + _seq(3, 11) + [7], _seq(9, 30) + [2, 3]):
        assert fresh.match_prefix(probe).cached_len == cache.match_prefix(probe).cached_len


def test_a_tree_too_big_for_the_slots_loads_nothing():
    """The pages fit, the slots do not: ``ValueError`` naming both needs and what the cache
    has, and the cache is left as it was (no page held by nobody: a restore into pools a
    moved split made smaller leaked every page before)."""
    cache = make_cache(True, num_pages=512, num_slots=16)
    for i in range(6):
        serve(cache, _seq(20 + i, 12), output=(1,))
    tree = dump_tree(cache)
    small = make_cache(True, num_pages=512, num_slots=len(tree["slots"]) - 1)
    before = small.stats()
    try:
        load_tree(small, tree)
    except ValueError as err:
        assert f"{len(tree['slots'])} state slots" in str(err), err
        assert f"{len(tree['slots']) - 1} slots" in str(err), err
    else:
        raise AssertionError("a tree needing more slots than the cache has loaded")
    assert small.stats() == before
    small.check_integrity()
