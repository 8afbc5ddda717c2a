"""IdAllocator: reserved id 0, batched alloc/free, ownership transitions, misuse detection."""

from __future__ import annotations

import numpy as np
import pytest

from mambacache.cache.allocator import FREE, HELD, TREE, IdAllocator


def test_ids_start_at_one_and_exhaust_to_none():
    a = IdAllocator(5, "slot")
    ids = a.alloc(5)
    assert sorted(ids.tolist()) == [1, 2, 3, 4, 5]
    assert ids.dtype == np.int32
    assert a.alloc(1) is None
    assert a.num_free == 0 and a.num_held == 5
    a.check()


def test_alloc_zero_and_negative():
    a = IdAllocator(3)
    assert a.alloc(0).shape == (0,)
    with pytest.raises(ValueError):
        a.alloc(-1)


def test_free_returns_ids_and_counts():
    a = IdAllocator(4)
    ids = a.alloc(3)
    a.free(ids[:2])
    assert a.num_free == 3 and a.num_held == 1
    assert a.held_ids().tolist() == [int(ids[2])]
    a.check()


@pytest.mark.parametrize("bad", [[0], [5], [-1], [2**31 - 1], [1, 9]])
def test_foreign_ids_raise(bad):
    a = IdAllocator(4)
    a.alloc(4)
    with pytest.raises(ValueError, match="foreign"):
        a.free(np.array(bad, dtype=np.int32))
    with pytest.raises(ValueError, match="foreign"):
        a.free(bad)  # plain list path
    a.check()


def test_double_free_raises():
    a = IdAllocator(4)
    ids = a.alloc(2)
    a.free(ids)
    with pytest.raises(ValueError, match="double free"):
        a.free(ids[:1])
    with pytest.raises(ValueError, match="double free"):
        a.free(ids)
    a.check()


def test_duplicates_in_one_call_raise():
    a = IdAllocator(6)
    ids = a.alloc(3)
    with pytest.raises(ValueError, match="duplicate"):
        a.free(np.array([ids[0], ids[1], ids[0]], dtype=np.int32))
    a.check()
    a.free(ids)
    a.check()


def test_tree_ownership_transitions():
    a = IdAllocator(4)
    ids = a.alloc(3)
    a.adopt(ids[:2])
    assert a.num_tree == 2 and a.num_held == 1
    assert a.status_of(ids).tolist() == [TREE, TREE, HELD]
    with pytest.raises(ValueError, match="wrong owner"):
        a.free(ids[:1])  # a request cannot free a tree-owned id
    with pytest.raises(ValueError, match="wrong owner"):
        a.release(ids[2:])  # the tree cannot release a request's id
    a.release(ids[:2])
    assert a.status_of(ids[:2]).tolist() == [FREE, FREE]
    a.check()


def test_check_detects_corruption():
    a = IdAllocator(4)
    ids = a.alloc(2)
    a._status[int(ids[0])] = FREE  # simulate a lost id
    with pytest.raises(AssertionError):
        a.check()


def test_bad_size():
    with pytest.raises(ValueError):
        IdAllocator(0)


# Calls with at most 8 ids take a pure-Python path, larger ones the vectorised path: every
# misuse must be caught on both, with nothing changed when it is.
@pytest.mark.parametrize("n", [2, 8, 9, 20])
def test_misuse_caught_on_both_paths(n):
    a = IdAllocator(64)
    ids = a.alloc(n)
    before = a.status_of(np.arange(1, 65, dtype=np.int32)).copy()
    cases = [
        ("duplicate", np.concatenate([ids[:-1], ids[:1]])),
        ("foreign", np.concatenate([ids[:-1], np.array([65], np.int32)])),
        ("foreign", np.concatenate([ids[:-1], np.array([-3], np.int32)])),
        ("foreign", np.concatenate([ids[:-1], np.array([10**6], np.int32)])),
    ]
    for match, bad in cases:
        for method, arg in ((a.free, bad), (a.adopt, bad), (a.free, bad.tolist())):
            with pytest.raises(ValueError, match=match):
                method(arg)
        assert (a.status_of(np.arange(1, 65, dtype=np.int32)) == before).all()
        a.check()
    a.adopt(ids)
    with pytest.raises(ValueError, match="wrong owner"):
        a.free(ids)
    a.release(ids)
    with pytest.raises(ValueError, match="double free"):
        a.free(ids)
    with pytest.raises(ValueError, match="double free"):
        a.release(ids)
    assert a.num_free == 64 and a.num_held == 0 and a.num_tree == 0
    a.check()


@pytest.mark.parametrize("n", [1, 8, 9, 30])
def test_release_trusted_and_alloc_agree_on_both_paths(n):
    a = IdAllocator(40)
    ids = a.alloc(n)
    a.adopt(ids)
    a.release_trusted(ids)
    assert a.num_free == 40 and a.num_tree == 0
    a.check()
    again = a.alloc(n)  # the released ids come back first (a stack)
    assert sorted(again.tolist()) == sorted(ids.tolist())
    assert (a.status_of(again) == HELD).all()
    a.check()


def test_alloc_one_is_alloc_of_one():
    """``alloc_one`` (a decode row's page at page size 1) hands out the id ``alloc(1)`` would,
    HELD and counted, and None once the pool is empty."""
    a, b = IdAllocator(3), IdAllocator(3)
    b.free(b.alloc(2)[::-1])  # a free stack out of id order: the top is what counts
    a.free(a.alloc(2)[::-1])
    for _ in range(3):
        one, arr = a.alloc_one(), b.alloc(1)
        assert type(one) is int and one == int(arr[0])
        assert a.status_of(np.asarray([one]))[0] == HELD
        assert (a.num_free, a.num_held) == (b.num_free, b.num_held)
    assert a.alloc_one() is None and b.alloc(1) is None
    a.check()
