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

from typing import Any

import numpy as np

from mambacache.cache.allocator import FREE, HELD
from mambacache.engine.step_plan import step_hazards


def _own_slots(req: Any) -> set[int]:
    return {req.running_slot, *req.pending_snapshots.values(), *req.scratch_slots} - {None}


def _cache_ids(cache: Any, slots: list[int]) -> np.ndarray:
    """The slots the cache allocator manages (scratch slots of speculative lanes are above)."""
    return np.asarray([s for s in slots if s <= cache.slots.num_ids], np.int64)


def _check_row(cache: Any, s: Any, page_size: int) -> list[str]:
    spec, req = s.spec, s.req
    rid = req.request_id
    problems = []
    read = spec.read_slot
    if read:
        node = req.match_node
        locked_state = (node is not None and getattr(node, "slot", None) == read
                        and getattr(node, "mamba_lock_ref", 0) > 0)
        if read > cache.slots.num_ids and read not in req.scratch_slots:
            problems.append(f"request {rid} reads scratch slot {read} of another lane")
        elif read <= cache.slots.num_ids and cache.slots.status_of(np.asarray([read]))[0] == FREE:
            problems.append(f"request {rid} reads FREE slot {read}")
        elif read not in _own_slots(req) and not locked_state:
            problems.append(f"request {rid} reads slot {read}: neither its own nor locked")
    written = spec.written_slots()
    in_cache = _cache_ids(cache, written)
    if in_cache.size and (cache.slots.status_of(in_cache) != HELD).any():
        problems.append(f"request {rid} writes slots {written} not all held by a request")
    if not set(written) <= _own_slots(req):
        problems.append(f"request {rid} writes slots {written}, holds {sorted(_own_slots(req))}")
    pages = spec.written_pages(page_size)
    if pages.size and (cache.pages.status_of(pages) != HELD).any():
        problems.append(f"request {rid} writes pages {pages.tolist()} it does not hold")
    if not set(pages.tolist()) <= set(req.own_page_ids.tolist()):
        problems.append(f"request {rid} writes pages outside its own {req.own_page_ids.tolist()}")
    read_pages = spec.read_pages(page_size)
    if read_pages.size and (cache.pages.status_of(read_pages) == FREE).any():
        problems.append(f"request {rid} reads FREE pages")
    return problems


def check_step(cache: Any, scheduled: list[Any], page_size: int) -> None:
    """Raise ``AssertionError`` listing every broken step invariant."""
    problems = step_hazards([s.spec for s in scheduled], page_size)
    for s in scheduled:
        problems += _check_row(cache, s, page_size)
    if problems:
        raise AssertionError("step invariants broken: " + "; ".join(problems))
