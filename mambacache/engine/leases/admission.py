"""Admission: whether a waiting request starts now, and what its lease holds when it does.

``admit(manager, req, running, waiting)`` is step 1 of the scheduler's request life
(``scheduler.py``): promote what the host tier holds deeper than the device
(``CacheManager.promote``), match the prefix, then ``Lease.admit`` (lock the matched node, check the
prompt's pages are available, take one running slot) and ``Lease.plan_prefill`` (the snapshot
positions of ``snapshot_plan.plan_snapshots`` plus the in-batch dedup positions of
``dedup.shared_with_waiting``, with slots). Verdicts: "ok" (the lease holds its lock, running
slot and snapshot slots; the scheduler moves the request to the running list), "defer" (a
running prefill will publish a longer shared prefix: ``dedup.inflight_branch``) or "full"
(back-pressure: the pools are short, or with a byte budget the running requests' own bytes
would pass its ``running_share``, ``CacheManager.holds_back``; never while nothing runs, so a
request that fits the pools alone always starts). Nothing is held unless "ok".

Host only, no JAX; called once per examined waiting request, so its cost is per admission:
numpy only where an array is the result (page ids), no per-token Python work.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from mambacache.cache.node import MatchResult
from mambacache.engine.leases.cache_manager import CacheManager
from mambacache.engine.leases.dedup import inflight_branch, shared_with_waiting
from mambacache.engine.request import Request


def admit(manager: CacheManager, req: Request, running: Sequence[Request],
          waiting: Iterable[Request]) -> str:
    """Try to start ``req``: "ok", "defer" or "full" (see the module docstring)."""
    gained = manager.promote(req.token_ids, req.extra_key)  # [host tier] deeper host states
    m = manager.match(req.token_ids, req.extra_key)
    if manager.holds_back(running, m, req.prompt_len + len(req.output_ids)):
        return "full"  # the budget's running share: wait for a running request to finish
    branch_len = inflight_branch(manager, req, running, m.cached_len, m.branch_len)
    if branch_len is None:
        return "defer"
    verdict = _start(manager, req, waiting, m, branch_len)
    if verdict == "full" and not running and m.cached_len > 0:
        # Nothing running will free anything: what is short is what the match would lock
        # (its state slot or pages). Start from scratch; the tree may evict it.
        verdict = _start(manager, req, waiting, manager.empty_match(m), branch_len)
    if gained and verdict == "ok":
        manager.count_host_hit(min(gained, req.lease.num_computed))
    return verdict


def _start(manager: CacheManager, req: Request, waiting: Iterable[Request], m: MatchResult,
           branch_len: int) -> str:
    """Admit ``req``'s lease from ``m`` and plan its snapshots; "ok" or "full"."""
    # the tokens to compute: len(req.token_ids), a preempted request's outputs included
    num_tokens = req.prompt_len + len(req.output_ids)
    if not req.lease.admit(m, num_tokens):
        return "full"
    if req.num_preemptions == 0:
        req.cached_tokens = m.cached_len
    req.lease.plan_prefill(num_tokens, m.cached_len, branch_len,
                           lambda: shared_with_waiting(manager, req, waiting, m.cached_len),
                           req.prompt_len)
    return "ok"
