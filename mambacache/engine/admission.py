"""Admission: whether a waiting request starts now, and what it holds when it does.

``admit(sched, req)`` is step 1 of the scheduler's request life (``scheduler.py``): match the
prefix, lock the matched node, then (with the lock counted, so what it pins is no longer
evictable) check that the prompt's pages are available and take one running slot; plan the
snapshot positions (``snapshot_plan.plan_snapshots`` plus the in-batch dedup positions of
``dedup.shared_with_waiting``) and give them slots. Verdicts: "ok" (running, holds its lock,
running slot and snapshot slots), "defer" (a running prefill will publish a longer shared
prefix: ``dedup.inflight_branch``) or "full" (back-pressure). Nothing is held unless "ok".

Host only, no JAX; called once per examined waiting request, so its cost is per admission:
numpy only where an array is the result (page ids), no per-token Python work.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mambacache.cache.node import MatchResult, as_tokens
from mambacache.cache.snapshot_plan import assign_snapshot_slots, plan_snapshots
from mambacache.engine.dedup import inflight_branch, shared_with_waiting
from mambacache.engine.request import Request, Status

#: the empty page list a request starts with (shared, read only: page arrays are reassigned,
#: never written in place)
NO_PAGES = np.zeros(0, np.int32)
NO_PAGES.flags.writeable = False


def admit(sched: Any, req: Request) -> str:
    """Try to start ``req``: "ok", "defer" or "full" (see the module docstring)."""
    m = sched.cache.match_prefix(req.token_ids, extra_key=req.extra_key)
    branch_len = inflight_branch(sched, req, m.cached_len, m.branch_len)
    if branch_len is None:
        return "defer"
    verdict = _start(sched, req, m, branch_len)
    if verdict == "full" and not sched.running and m.cached_len > 0:
        # Nothing running will free anything: what is short is what the match would lock
        # (its state slot or pages). Start from scratch; the tree may evict it.
        verdict = _start(sched, req, empty_match(m), branch_len)
    return verdict


def _start(sched: Any, req: Request, m: MatchResult, branch_len: int) -> str:
    """Lock ``m.node``, take the running slot and plan the snapshots; "ok" or "full"."""
    cache, ps = sched.cache, sched.page_size
    # the tokens to compute: len(req.token_ids), a preempted request's outputs included
    num_tokens = req.prompt_len + len(req.output_ids)
    need_pages = -(-num_tokens // ps) - m.cached_len // ps
    cache.lock(m.node)  # locked first, so what it pins no longer counts as evictable
    slots = None
    if cache.available_pages() >= need_pages:
        slots = cache.alloc_slots(1)
    if slots is None:
        cache.unlock(m.node)
        return "full"
    req.match_node, req.read_slot, req.running_slot = m.node, m.read_slot, int(slots[0])
    req.cached_page_ids = as_tokens(m.page_ids)  # int32 already: no copy
    req.own_page_ids = NO_PAGES
    req.num_computed = m.cached_len
    if req.num_preemptions == 0:
        req.cached_tokens = m.cached_len
    req.prefilled = False
    if sched.cfg.cache.enable:
        positions = plan_snapshots(num_tokens, m.cached_len, branch_len, ps,
                                   sched.cfg.cache.checkpoint_interval)
        shared = shared_with_waiting(sched, req, m.cached_len)
        positions = sorted(set(positions) | shared) if shared else positions
        req.pending_snapshots = assign_snapshot_slots(cache, positions, branch_len, num_tokens,
                                                      ps)
    req.status = Status.RUNNING
    req.state_valid = False
    sched.running.append(req)
    return "ok"


def empty_match(m: MatchResult) -> MatchResult:
    """``m`` without its hit: nothing cached, the root of ``m.node``'s tree as the node."""
    root = m.node
    while root.parent is not None:
        root = root.parent
    return MatchResult(0, m.page_ids[:0], None, root, 0)
