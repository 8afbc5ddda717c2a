"""A lease's page growth: one page at a time (``Lease.take_page``, a decode row at page size 1)
and a whole step's rows at once (``CacheManager.grow_rows``) take the same ids as ``grow`` one
after another through ``alloc_pages``, and never change a page array already handed out."""

from __future__ import annotations

import types

import numpy as np
import pytest

from mambacache.config import CacheConfig
from mambacache.engine.leases.cache_manager import CacheManager


def _leases(page_size: int, num: int) -> tuple[CacheManager, list]:
    mgr = CacheManager(CacheConfig(page_size=page_size, num_kv_tokens=64 * page_size,
                                   num_mamba_slots=8, enable=False))
    leases = []
    for _ in range(num):
        lease = mgr.lease()
        assert lease.admit(mgr.match(np.zeros(0, np.int32), None), 1)
        leases.append(lease)
    return mgr, leases


@pytest.mark.parametrize("page_size", [1, 4])
def test_grow_one_page_at_a_time_matches_alloc_pages(page_size):
    mgr, (lease,) = _leases(page_size, 1)
    ref, _ = _leases(page_size, 1)  # the same pools, the same running slot taken
    expect, seen = [], []
    for end in range(1, 40 * page_size, 3):
        old = [(a, a.copy()) for a in seen]
        assert lease.grow(end)
        need = -(-end // page_size) - len(expect)
        if need > 0:  # what one alloc_pages per growth hands out
            expect += ref.cache.alloc_pages(need).tolist()
        seen.append(lease.page_ids)
        assert lease.page_ids.tolist() == expect
        for a, copy in old:  # arrays handed out earlier never change
            np.testing.assert_array_equal(a, copy)
    np.testing.assert_array_equal(np.sort(lease.page_ids), mgr.cache.pages.held_ids())


def test_grow_rows_takes_the_ids_of_grows_in_order():
    """Rows short of one page and of several: ``grow_rows`` gives each the ids its own ``grow``
    in row order would have got."""
    ends = [5, 1, 9, 2]
    mgr, leases = _leases(1, len(ends))
    _, alone = _leases(1, len(ends))
    rows = [(types.SimpleNamespace(lease=lease), end)
            for lease, end in zip(leases, ends, strict=True)]
    assert mgr.grow_rows(rows)
    for lease, end in zip(alone, ends, strict=True):
        assert lease.grow(end)
    for a, b in zip(leases, alone, strict=True):
        np.testing.assert_array_equal(a.page_ids, b.page_ids)
