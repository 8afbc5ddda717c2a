"""plan_snapshots / end_snapshot_position / assign_snapshot_slots."""

from __future__ import annotations

import pytest

from mambacache.cache.radix import make_cache
from mambacache.cache.snapshot_plan import (
    assign_snapshot_slots,
    end_snapshot_is_running_state,
    end_snapshot_position,
    plan_snapshots,
)


def test_cold_prompt_snapshots_last_but_one():
    assert plan_snapshots(1000, 0, 0, 1, 0) == [999]


def test_branch_point_and_last():
    assert plan_snapshots(100, 16, 40, 1, 0) == [40, 99]


def test_rounded_down_to_pages_and_unique():
    # branch 45 -> 40, last 99 -> 96; checkpoint every 30 -> 30->24, 60->56, 90->88
    assert plan_snapshots(100, 0, 45, 8, 30) == [24, 40, 56, 88, 96]


def test_strictly_between_cached_and_prompt_len():
    # identical prompt already cached up to 999: nothing to plan
    assert plan_snapshots(1000, 999, 1000, 1, 0) == []
    # rounding down lands on cached_len: excluded
    assert plan_snapshots(20, 16, 16, 16, 0) == []
    for p in plan_snapshots(500, 64, 200, 16, 50):
        assert 64 < p < 500 and p % 16 == 0


def test_checkpoints_are_absolute_multiples():
    assert plan_snapshots(100, 35, 35, 1, 20) == [40, 60, 80, 99]


def test_bad_arguments():
    with pytest.raises(ValueError):
        plan_snapshots(10, 5, 4, 1, 0)  # cached > branch
    with pytest.raises(ValueError):
        plan_snapshots(10, 10, 10, 1, 0)  # cached == prompt_len
    with pytest.raises(ValueError):
        plan_snapshots(10, 0, 0, 0, 0)


def test_end_snapshot_position():
    assert end_snapshot_position(1001, 1) == 1000
    assert end_snapshot_position(1001, 16) == 992
    assert end_snapshot_is_running_state(1001, 1)
    assert not end_snapshot_is_running_state(1001, 16)
    assert end_snapshot_is_running_state(33, 16)


def test_assign_prefers_branch_and_last_and_counts_skips():
    # 3 slots: the branch point takes one; speculative ones keep free >= held: one more
    cache = make_cache(True, num_pages=64, num_slots=3, page_size=1)
    got = assign_snapshot_slots(cache, [10, 20, 30, 49], branch_len=20, prompt_len=50)
    assert sorted(got) == [20, 49]
    assert cache.stats()["snapshots_skipped"] == 2
    assert cache.slots.num_held == 2 and cache.spec_slots == {got[49]}
    cache.check_integrity()


def test_assign_all_when_room():
    cache = make_cache(True, num_pages=64, num_slots=8, page_size=1)
    got = assign_snapshot_slots(cache, [10, 20, 30], branch_len=10, prompt_len=31)
    assert sorted(got) == [10, 20, 30] and len(set(got.values())) == 3
    assert cache.stats()["snapshots_skipped"] == 0
