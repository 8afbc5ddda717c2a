"""Shared helpers for the radix cache tests: drive a request the way the engine does."""

from __future__ import annotations

import numpy as np

from mambacache.cache.snapshot_plan import (
    assign_snapshot_slots,
    end_snapshot_is_running_state,
    end_snapshot_position,
    plan_snapshots,
)


def start(cache, prompt, extra_key=None, checkpoint_interval=0):
    """match + lock + running slot + pages + planned snapshot slots; None on back-pressure."""
    ps = cache.page_size
    prompt = np.asarray(prompt, dtype=np.int32)
    m = cache.match_prefix(prompt, extra_key=extra_key)
    cache.lock(m.node)
    slot = cache.alloc_slots(1)
    if slot is None:
        cache.unlock(m.node)
        return None
    return m, int(slot[0]), plan_and_assign(cache, prompt, m, checkpoint_interval, ps)


def plan_and_assign(cache, prompt, m, checkpoint_interval, ps):
    pos = plan_snapshots(len(prompt), m.cached_len, m.branch_len, ps, checkpoint_interval)
    return assign_snapshot_slots(cache, pos, m.branch_len, len(prompt), ps)


def finish(cache, prompt, output, m, running_slot, snaps, extra_key=None):
    """Allocate the pages of prompt + output[:-1], insert, unlock. Returns the InsertResult."""
    ps = cache.page_size
    tokens = np.concatenate([np.asarray(prompt, np.int32), np.asarray(output[:-1], np.int32)])
    own = cache.alloc_pages(-(-len(tokens) // ps) - m.cached_len // ps)
    assert own is not None
    pages = np.concatenate([m.page_ids, own])
    total = len(tokens) + 1
    snaps = dict(snaps)
    if end_snapshot_is_running_state(total, ps):
        snaps[end_snapshot_position(total, ps)] = running_slot
    else:
        cache.free_slots([running_slot])
    res = cache.insert(tokens, pages, snaps, extra_key=extra_key)
    cache.unlock(m.node)
    return res


def serve(cache, prompt, output=(7,), extra_key=None, checkpoint_interval=0):
    """One request start to finish; returns its MatchResult."""
    got = start(cache, prompt, extra_key, checkpoint_interval)
    assert got is not None
    m, slot, snaps = got
    finish(cache, prompt, list(output), m, slot, snaps, extra_key)
    cache.check_integrity()
    return m
