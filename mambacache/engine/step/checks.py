"""``check_step``: the invariants of one scheduled step, against the allocators and the tree.

Run before the step under ``scheduler.check_integrity_every_step`` (and by the fuzz test):
  * no cross-row conflict (``step_hazards``: a slot or page written by one row and read or
    written by another);
  * no row reads a FREE slot or a FREE page;
  * every slot a row reads is held by the reading request (its running slot or a snapshot it
    planned) or is the state of its matched node, locked in the tree;
  * every slot and page a row writes is held by that request (never the tree's, never free).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from mambacache.cache.allocator import FREE, HELD
from mambacache.cache.base import CacheBase
from mambacache.engine.step.plan import ScheduledSeq, step_hazards


def _cache_ids(cache: CacheBase, slots: list[int]) -> np.ndarray:
    """The slots the cache allocator manages (scratch slots of speculative lanes are above)."""
    return np.asarray([s for s in slots if s <= cache.slots.num_ids], np.int64)


def _check_row(cache: CacheBase, s: ScheduledSeq, page_size: int) -> list[str]:
    spec, lease = s.spec, s.req.lease
    rid = s.req.request_id
    own = lease.own_slots()
    problems = []
    read = spec.read_slot
    if read:
        node = lease.node
        locked_state = (node is not None and getattr(node, "slot", None) == read
                        and getattr(node, "mamba_lock_ref", 0) > 0)
        if read > cache.slots.num_ids and read not in lease.scratch_slots:
            problems.append(f"request {rid} reads scratch slot {read} of another lane")
        elif read <= cache.slots.num_ids and cache.slots.status_of(np.asarray([read]))[0] == FREE:
            problems.append(f"request {rid} reads FREE slot {read}")
        elif read not in own and not locked_state:
            problems.append(f"request {rid} reads slot {read}: neither its own nor locked")
    written = spec.written_slots()
    in_cache = _cache_ids(cache, written)
    if in_cache.size and (cache.slots.status_of(in_cache) != HELD).any():
        problems.append(f"request {rid} writes slots {written} not all held by a request")
    if not set(written) <= own:
        problems.append(f"request {rid} writes slots {written}, holds {sorted(own)}")
    pages = spec.written_pages(page_size)
    if pages.size and (cache.pages.status_of(pages) != HELD).any():
        problems.append(f"request {rid} writes pages {pages.tolist()} it does not hold")
    if not set(pages.tolist()) <= lease.writable_pages():
        problems.append(f"request {rid} writes pages outside its own "
                        f"{sorted(lease.writable_pages())}")
    read_pages = spec.read_pages(page_size)
    if read_pages.size and (cache.pages.status_of(read_pages) == FREE).any():
        problems.append(f"request {rid} reads FREE pages")
    return problems


def check_step(cache: CacheBase, scheduled: Sequence[ScheduledSeq], page_size: int) -> None:
    """Raise ``AssertionError`` listing every broken step invariant."""
    problems = step_hazards([s.spec for s in scheduled], page_size)
    for s in scheduled:
        problems += _check_row(cache, s, page_size)
    if problems:
        raise AssertionError("step invariants broken: " + "; ".join(problems))
