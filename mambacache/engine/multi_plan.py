"""Multi-step decode on the host: which steps run ``scheduler.decode_steps`` (K) iterations in
one dispatch, and each row's iterations, pages, boundary snapshot and first token.

The scheduler's decode side when K > 1 (``Scheduler.schedule`` calls both functions; the device
side is ``engine/runners/multi_step.py``, the oracle's ``engine/shadow/multi.py``). A step runs K
only if every running request decodes and nothing waiting could be admitted now (TTFT first: an
admissible request makes the step a plain one), and every row stops on the device only. A row
runs ``steps`` <= K iterations (``ScheduledSeq.steps``): up to its ``max_new_tokens``, one page
boundary at most (its state to a fresh slot, ``Lease.plan_decode_window``), the pages the pool
gives (a short pool is back-pressure: fewer iterations, never a failure), one after a plain row
in flight (whose stop the device cannot see). Host only, no JAX.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from mambacache.engine.request import RUNNING
from mambacache.engine.step.plan import MAX_DEVICE_STOPS, PLACEHOLDER, ScheduledSeq, SeqSpec

if TYPE_CHECKING:
    from mambacache.engine.leases.cache_manager import CacheManager
    from mambacache.engine.request import Request


def multi_step_ok(manager: CacheManager, decoding: Sequence[tuple[Request, int]],
                  waiting: Sequence[Request], free_running: int) -> bool:
    """Whether a decode-only step of ``decoding`` (request, its end) runs K iterations: no
    waiting request could be admitted now (the queue is empty, its head has a token in flight,
    or ``free_running`` (running places left) is 0: an admission then waits for the next
    dispatch, at most K - 1 iterations longer), no host tier load in flight, and every row
    stops on the device only (no penalties or grammar, no stop strings at the server:
    ``SamplingParams.host_stops``, fewer than ``MAX_DEVICE_STOPS`` stop ids, no snapshot
    planned past its start). No mutation."""
    if manager.loads_in_flight():
        return False
    if waiting and not waiting[0].num_pending and free_running > 0:
        return False  # admit first (TTFT); the next decode-only step runs K again
    for req, _ in decoding:
        p, lease = req.params, req.lease
        if p.needs_history or p.host_stops or len(p.stop_token_ids) >= MAX_DEVICE_STOPS:
            return False
        if lease.pending_snapshots and max(lease.pending_snapshots) > lease.num_computed:
            return False
    return True


def multi_step_rows(manager: CacheManager, decoding: Sequence[tuple[Request, int]], k: int,
                    out: dict[int, ScheduledSeq],
                    grow_or_preempt: Callable[[Request, int], bool], *,
                    after_plain: bool) -> None:
    """One row per decoding request into ``out`` (request id -> row), each running up to ``k``
    iterations (module docstring); ``after_plain``: the step in flight is a plain one (a row
    fed by it runs one iteration). ``grow_or_preempt(req, end)``: the scheduler's K = 1 growth
    (may preempt, removing rows from ``out``). Mutates the leases (pages, boundary snapshot)."""
    ps, boundary = manager.page_size, manager.boundary_snapshots
    for req, _ in decoding:
        if req.status is not RUNNING:
            continue  # preempted to grow an earlier row
        lease = req.lease
        start = lease.num_computed
        n = min(k, req.params.max_new_tokens - len(req.output_ids) - req.num_pending)
        if req.num_pending and after_plain:
            # [overlap] after a plain row, whose stop the device cannot see: its pending token
            # only (K = 1's chained row); the next multi-step row is frozen if this one stops
            n = 1
        if boundary:
            n = min(n, (start // ps + 2) * ps - 1 - start)
        if not lease.grow(start + n):
            n = min(n, lease.room(start))
            if n < 1:
                if not grow_or_preempt(req, start + 1):
                    continue
                n = 1
        out[req.request_id] = _row(req, start, n, boundary)


def _row(req: Request, start: int, n: int, boundary: bool) -> ScheduledSeq:
    """Request ``req``'s row of ``n`` iterations from ``start`` (pages grown): its first
    iteration's spec, its boundary snapshot (the state after the row if it ends there)."""
    lease = req.lease
    known = req.prompt_len + len(req.output_ids)
    if req.num_pending:  # [overlap] its newest token is on the device
        if start != known + req.num_pending - 1:
            raise AssertionError(f"request {req.request_id}: row at {start} with {known} "
                                 f"tokens known, {req.num_pending} pending")
        tokens, prev = PLACEHOLDER, req.pending_row
    else:
        tokens, prev = req.token_slice(start, start + 1), -1
    s = ScheduledSeq(req, start, start + n, steps=n)
    running = lease.running_slot
    s.spec = SeqSpec(tokens, start, lease.page_ids, lease.next_read_slot, running, [], "last",
                     prev)
    s.write_slot = running
    window = lease.plan_decode_window(start, start + n) if boundary else None
    if window is not None:
        s.snap_iter, s.snap_slot = window[0] - start - 1, window[1]
        if window[0] == start + n:  # the state after the row is the snapshot's
            s.write_slot = window[1]
    return s
