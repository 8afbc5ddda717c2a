"""The step loop: schedule, dispatch, read, at overlap depth 0 (synchronous) or 1 (overlapped).

One ``Engine.step`` call:
  1. schedule step N (the scheduler; ends released while scheduling get their speculative
     scratch states copied first);
  2. dispatch it to the ``Runner`` and record its progress (``Scheduler.advance``: device order
     puts every later step after it, so its states and pages may be published and read from
     now on); a verify row's progress waits for its tokens;
  3. read a step's sampled tokens: at depth 0 step N's own; at depth 1 step N-1's, so the device
     never waits for the host between steps (``scheduler.overlap``). Append them, check stop
     conditions, finish requests (``step_read.py``);
  4. [depth 1] mark N's sampling rows pending (``Request.num_pending``): the next step's decode
     row of such a request feeds its last token from the device (``SeqSpec.prev_index``), a
     request whose pending token is its last by length gets no row, one with a token in flight
     is never admitted. A request that stopped at N-1 has a row in N computing past the stop
     token: it was released with everything up to the stop inserted, and its N token is
     dropped when read (it is FINISHED by then). Once nothing is unfinished, a step still in
     flight holds only dropped rows: it is read then, so an idle engine has nothing in flight.

[speculative, drafts on the host (``ngram``)] A request's next drafts depend on the tokens its
row in flight samples: at depth 1 that step is read before the next one is scheduled (when a
row of it samples for a running request), so every verify row is the synchronous loop's (the
same drafts on the same steps). Drafts made on the device (``mtp``) chain instead
(``engine/speculative/chain.py``).

[multi-step decode] A step the scheduler planned with ``iterations`` K > 1 is dispatched with
``Runner.run_multi``: each row samples up to its ``steps`` tokens (``[K, rows]``), all pending
at once; the read cuts a row at its first stop token (the device froze it there) and rewinds its
lease to the tokens computed before the finish inserts them (``Scheduler.rewind``).

Failures: a dispatch that raises fails its own requests (``fail_step``); at depth 1 step N-1 is
still read for the others. If the runner says the donated pools are gone, or a read raises,
every request running or with a token in flight fails and the pools and the cache restart empty
(no state can outlive its pools; the device state behind the steps in flight is unknown).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
from absl import logging

from mambacache.engine.request import FINISHED, RUNNING, RequestOutput
from mambacache.engine.runner_protocol import InFlight
from mambacache.engine.step.plan import ScheduledSeq, first_logit_row
from mambacache.engine.step_read import StepReader

if TYPE_CHECKING:
    from mambacache.engine.engine import Engine


class StepLoop:
    """The engine's one step loop (module docstring); ``depth`` 0 or 1."""

    def __init__(self, engine: Engine, depth: int):
        if depth not in (0, 1):
            raise ValueError(f"overlap depth must be 0 or 1, got {depth}")
        self.engine = engine
        self.depth = depth
        self.in_flight: InFlight | None = None  # [depth 1] dispatched, tokens not read yet
        self.spec = engine.scheduler.speculative  # [speculative] verify rows, slot copies
        # read per row: the engine's parts, fixed for its life
        self.scheduler, self.stats = engine.scheduler, engine.stats
        self.reader = StepReader(engine, depth)  # a read step's tokens to their requests

    def step(self) -> list[RequestOutput]:
        """Schedule, run and account one step; the requests whose last token was read."""
        e, t_start = self.engine, time.perf_counter()
        check = e.cfg.scheduler.check_integrity_every_step
        outs: list[RequestOutput] = []
        wait_s, read_first = 0.0, False
        if self.in_flight is not None and self._drafts_need_tokens(self.in_flight):
            fl, self.in_flight, read_first = self.in_flight, None, True  # [host drafts]
            wait_s = self._read(fl, outs)
        scheduled = e.scheduler.schedule()
        if self.spec is not None:
            self._flush_slot_copies()  # ends released while scheduling (preemption)
        if not scheduled and self.in_flight is None and not read_first:
            return []
        if scheduled and check:
            e.scheduler.check_step(scheduled)
        launched = self._dispatch(scheduled, outs) if scheduled else None
        if launched is None and scheduled and not self.depth:
            self._settle_loads()
            return outs  # the synchronous step failed: nothing ran, nothing to read
        if self.depth:
            to_read, self.in_flight = self.in_flight, launched
        else:
            to_read = launched
        if to_read is not None:
            wait_s += self._read(to_read, outs)
        if self.depth:
            if launched is not None and self.in_flight is launched:
                for i, row in launched.rows:
                    s = launched.scheduled[i]
                    if s.req.status is RUNNING:
                        s.req.mark_pending(row, s.steps)
            if self.in_flight is not None and not e.has_unfinished():
                self._drop()  # only dropped rows are left in flight
        self._settle_loads()
        if self.spec is not None:
            self._flush_slot_copies()  # ends released by finishes
        now = time.perf_counter()
        e.stats.on_step(e, scheduled, host_s=now - t_start - wait_s, wall_s=now - t_start,
                        t_start=t_start)
        if check:
            e.check_integrity()
        return outs

    def _drafts_need_tokens(self, fl: InFlight) -> bool:
        """[speculative, overlap] Whether ``fl`` must be read before the next step is planned:
        the drafter proposes on the host from a request's tokens (``ngram``), and a row of
        ``fl`` samples for a request still running. Its next row's drafts depend on the token
        the row samples, so planning it first (a chained row) cannot draft what the
        synchronous loop drafts; this step runs synchronously instead (issue 39)."""
        if self.spec is None or self.spec.drafter.on_device:
            return False
        return any(fl.scheduled[i].req.status is RUNNING for i, _ in fl.rows)

    def _settle_loads(self) -> None:
        """[host tier] Idle: finish the loads of failed or aborted requests (nothing in flight
        is left to an idle engine)."""
        e = self.engine
        if not e.has_unfinished() and e.manager.loads_in_flight():
            e.manager.land_loads()

    # ---- dispatch and read -------------------------------------------------------------------
    def _dispatch(self, scheduled: list[ScheduledSeq],
                  outs: list[RequestOutput]) -> InFlight | None:
        """Run ``scheduled`` (asynchronously) and record its progress; None (its requests'
        failures appended to ``outs``) if the dispatch raised."""
        e, prev = self.engine, self.in_flight
        ready = getattr(prev.tokens, "is_ready", None) if prev is not None else None
        host_bound = ready() if ready is not None else None  # before the batch is built
        t_run = 0.0 if self.depth else time.perf_counter()
        iterations = self.scheduler.iterations
        try:
            if iterations > 1:
                tokens, logprobs = e.runner.run_multi(scheduled, iterations)
            else:
                copies = self.spec.page_copies(scheduled) if self.spec is not None else None
                if copies:  # [speculative tree, page size > 1] branches' first pages
                    e.runner.copy_pages(copies)
                tokens, logprobs = e.runner.run(scheduled)
        except AssertionError:
            raise  # a broken invariant (the shadow runner's data-flow check) is a bug: no retry
        except Exception as err:  # noqa: BLE001 - a failed step fails its requests only
            outs += self.fail_step(scheduled, err)
            return None
        # depth 0 counts the batch building as busy (the device waits for nothing else)
        e.stats.on_flight(t_run if not self.depth else time.perf_counter(), +1,
                          host_bound=host_bound)
        # the rows that sample, with their first logits row; before any token is pending
        advance, stats = self.scheduler.advance, self.stats
        if iterations > 1:  # [multi-step decode] every row a decode row that samples
            for s in scheduled:
                advance(s)
            return InFlight(scheduled, [(i, i) for i in range(len(scheduled))], tokens,
                            logprobs, iterations=iterations)
        if self.spec is None:  # one logits row per row, no verify row: one loop (per row)
            rows = []
            for i, s in enumerate(scheduled):
                req, start, end = s.req, s.start, s.end
                if end == req.prompt_len + len(req.output_ids) + req.num_pending:  # s.samples
                    rows.append((i, i))
                advance(s)  # pends no token: the samples test of later rows is unchanged
                if end - start > 1 or start < req.prompt_len:
                    stats.computed_prefill_tokens += end - start
            return InFlight(scheduled, rows, tokens, logprobs, e.runner.last_drafts)
        first = first_logit_row(scheduled)
        rows = [(i, first[i]) for i, s in enumerate(scheduled) if s.verifies or s.samples]
        self.spec.dispatched(scheduled)
        for s in scheduled:
            if not s.verifies:  # a verify row's progress depends on its tokens
                advance(s)
                if s.end - s.start > 1 or s.start < s.req.prompt_len:
                    stats.computed_prefill_tokens += s.end - s.start
        return InFlight(scheduled, rows, tokens, logprobs, e.runner.last_drafts)

    def _read(self, fl: InFlight, outs: list[RequestOutput]) -> float:
        """Wait for ``fl``'s tokens; append them to the requests still waiting for them (the
        finished ones' outputs to ``outs``). The seconds spent waiting for the device."""
        e, t_wait = self.engine, time.perf_counter()
        try:
            tokens, logprobs = np.asarray(fl.tokens), np.asarray(fl.logprobs)
        except AssertionError:
            raise
        except Exception as err:  # noqa: BLE001 - the device state behind the steps is unknown
            e.stats.on_flight(time.perf_counter(), -1)
            outs += self._fail_all(err)
            return time.perf_counter() - t_wait
        drafts = np.asarray(fl.drafts) if fl.drafts is not None else None
        if drafts is not None:  # [speculative mtp] keep the drafts for each row's next step
            self.spec.drafter.observe(fl.scheduled, drafts)
        now = time.perf_counter()
        e.stats.on_flight(now, -1)
        self.reader.read(fl, tokens, logprobs, drafts, now, outs)
        return now - t_wait

    def _drop(self) -> None:
        """Read the step in flight when no row of it has a reader left (the engine goes idle)."""
        fl, self.in_flight = self.in_flight, None
        if any(fl.scheduled[i].req.status is not FINISHED for i, _ in fl.rows):
            raise AssertionError("a step in flight samples for an unfinished request")
        try:
            np.asarray(fl.tokens)
        except Exception as err:  # noqa: BLE001 - no request is left to fail; the pools may be
            self._fail_all(err)
        finally:
            self.engine.stats.on_flight(time.perf_counter(), -1)

    def _fail_all(self, err: Exception) -> list[RequestOutput]:
        """A read raised: every request running or with a token in flight fails, and the step in
        flight with them (the pools-lost path of ``fail_step``)."""
        if self.in_flight is not None:
            self.in_flight = None
            self.engine.stats.on_flight(time.perf_counter(), -1)
        return self.fail_step([], err, lost=True)

    def _flush_slot_copies(self) -> None:
        """[speculative] Copy scratch end states into the running slots the tree adopted, before
        any later step can read them (the pools' data dependency orders it)."""
        if self.spec.slot_copies:
            self.engine.runner.copy_slots(self.spec.take_copies())

    # ---- failures ----------------------------------------------------------------------------
    def fail_step(self, scheduled: Sequence[ScheduledSeq], err: Exception, *,
                  lost: bool | None = None) -> list[RequestOutput]:
        """A step raised: fail its requests; if the donated pools are gone (``lost``: the runner
        says), everything running or with a token in flight fails and the pools and the cache
        start empty (no state can outlive its pools)."""
        e = self.engine
        sched = e.scheduler
        victims = [s.req for s in scheduled if not s.branch]  # [tree] a request's rows once
        lost = e.runner.pools_lost() if lost is None else lost
        if lost:
            victims += [r for r in sched.running if r not in victims]
            victims += [r for r in sched.waiting if r.num_pending]  # [overlap]
        logging.warning("step failed (%s: %s): %d requests fail%s", type(err).__name__, err,
                        len(victims), ", pools lost: the cache starts empty" if lost else "")
        for req in victims:
            req.error = f"{type(err).__name__}: {err}"
        if lost:
            sched.drop_all(victims)
            e.runner.reset_pools()
        else:
            for req in victims:
                sched.finish(req, "error", keep=False)
        outs = []
        for req in victims:
            e.requests.pop(req.request_id, None)
            outs.append(req.to_output())
        e.stats.failed_steps += 1
        return outs
