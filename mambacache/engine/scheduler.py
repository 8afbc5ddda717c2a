"""Continuous batching: the queues, chunked prefill, decode, preemption (policy).

One step mixes decode tokens (every running request past its prefill) with prefill chunks
(``chunked_prefill_size`` tokens in all). Per request, in order:
  1. admit (``admission.py``): match the prefix, lock the matched node, then (with the lock
     counted) check that the prompt's pages and one running slot are there; plan snapshots,
     including the positions where waiting requests share an uncached prefix with it (in-batch
     dedup, ``dedup.py``);
  2. run chunks; the first reads the cached state (``read_slot``), every chunk writes the
     running slot; planned snapshots are taken inside the chunk that covers their position and
     published to the tree before the next step's admissions (or by the finish, if that comes
     first), so a deferred request hits them next step;
  3. decode one token per step (only once the prefill is done: ``Lease.prefilled``);
  4. when a request cannot grow, the newest running request is preempted (its progress goes into
     the cache) until it can; the oldest request always progresses, so every configuration does;
  5. finish: insert everything computed, with the running slot as the end snapshot.
The scheduler decides *when*; each request's lease (``lease.py``, made by the ``CacheManager``)
decides *what*: every cache transition above is a lease method.

Host only: no JAX here (the simulator drives this same class with the shadow runner).
Invariants of a step (``check_step``, run under ``scheduler.check_integrity_every_step``): no row
reads a FREE slot; no slot or page is written by one row and read or written by another; every
slot a row reads is locked in the tree or held by the reading request.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import numpy as np
from absl import logging

from mambacache.config import EngineConfig
from mambacache.engine.leases.admission import admit
from mambacache.engine.leases.cache_manager import CacheManager
from mambacache.engine.multi_plan import multi_step_ok, multi_step_rows
from mambacache.engine.request import FINISHED, RUNNING, WAITING, Request
from mambacache.engine.speculative.verify import SpecDecoder
from mambacache.engine.step.plan import PLACEHOLDER, ScheduledSeq, SeqSpec

__all__ = ["ScheduledSeq", "Scheduler"]


class Scheduler:
    """Policy: the queues, the token budget, preemption. Cache state changes go through each
    request's lease (``lease.py``); the cache and its layout are the ``manager``'s."""

    def __init__(self, cfg: EngineConfig, manager: CacheManager):
        self.cfg = cfg
        self.manager = manager
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.tokens_computed = 0  # progress: tokens fed through the model, all requests
        self.num_finished = 0  # progress: requests finished (any reason)
        self.tokens_read = 0  # progress [overlap]: sampled tokens read one step late
        self._out: dict[int, ScheduledSeq] = {}
        self._to_publish: list[Request] = []  # prefills whose last step wrote snapshots
        # [host tier] running requests whose first chunk reads a state still loading
        self._load_waiters: list[Request] = []
        # [speculative] verify rows instead of decodes when a drafter proposes tokens
        self.speculative = SpecDecoder(cfg) if cfg.speculative.enabled else None
        # [multi-step decode] K iterations per decode-only step (the engine sets 1 on a runner
        # without them); ``iterations``: those of the step last scheduled
        self.decode_steps = cfg.scheduler.decode_steps
        self.iterations = 1
        self._multi_in_flight = False  # [overlap] the step in flight is a multi-step one

    # ---- pages -----------------------------------------------------------------------------
    def _grow_or_preempt(self, req: Request, end: int) -> bool:
        """Grow ``req`` to ``end`` tokens, preempting the newest running request until it fits;
        False if ``req`` itself was the newest and was preempted."""
        while not req.lease.grow(end):
            victim = self.running[-1]
            self.preempt(victim)
            if victim is req:
                return False
        return True

    def _spec(self, s: ScheduledSeq) -> SeqSpec:
        req, start, end = s.req, s.start, s.end
        lease = req.lease
        snaps = []
        if lease.pending_snapshots:  # most rows have none: no call
            # A snapshot that IS the step's final state is its write slot (no extra row
            # target), so a page-boundary decode keeps the decode program.
            snaps = [(pos - start, slot) for pos, slot in lease.row_snapshots(start, end)
                     if not (pos == end and slot == s.write_slot)]
        known = req.prompt_len + len(req.output_ids)
        if end <= known:
            tokens, prev = req.token_slice(start, end), -1
        else:  # [overlap] the last token is still on the device: a placeholder
            if req.num_pending != 1 or known + 1 != end:
                raise AssertionError(f"request {req.request_id}: row [{start}, {end}) needs "
                                     f"{req.num_pending} pending tokens")
            tokens = PLACEHOLDER if start == known else np.append(
                req.token_slice(start, known), np.int32(0))
            prev = req.pending_row
        # by position (per row of every step): tokens, prefix_len, page_ids, read_slot,
        # write_slot, snapshots, logits, prev_index
        return SeqSpec(tokens, start, lease.page_ids, lease.next_read_slot, s.write_slot, snaps,
                       "last", prev)

    # ---- one step --------------------------------------------------------------------------
    def schedule(self) -> list[ScheduledSeq]:
        """Choose this step's work: decodes, running prefill chunks, then new admissions."""
        self._out = out = {}
        if self.manager.loads_in_flight():  # [host tier] scatter the loads that have landed
            self.manager.land_loads(ready_only=True)
        if self._to_publish:
            for req in self._to_publish:
                if req.status is RUNNING:
                    req.lease.publish(req, final=req.lease.prefilled)
            self._to_publish.clear()
        # one pass over the running requests (per request of every step): the decode rows,
        # the prefills, and those whose last token is in flight ([overlap]: they take no row
        # and do not count against max_running_requests)
        decoding = []  # (request, its end: num_tokens)
        prefilling, num_done, held_back = [], 0, False
        for req in self.running:
            num_outputs = len(req.output_ids) + req.num_pending  # req.num_outputs, inline
            if num_outputs >= req.params.max_new_tokens:
                num_done += 1  # [overlap] its last token is in flight: it finishes when read
                if not req.lease.prefilled:
                    prefilling.append(req)
            elif not req.lease.prefilled:
                prefilling.append(req)
            elif req.num_pending and req.params.needs_history:
                held_back = True  # [overlap] penalties / grammar read its last token first
            elif req.status is RUNNING:
                decoding.append((req, req.prompt_len + num_outputs))
        if self.decode_steps > 1 and not prefilling and not held_back and decoding \
                and self.speculative is None and multi_step_ok(
                    self.manager, decoding, self.waiting,
                    self.cfg.scheduler.max_running_requests + num_done - len(self.running)):
            multi_step_rows(self.manager, decoding, self.decode_steps, out,
                            self._grow_or_preempt, after_plain=not self._multi_in_flight)
            if out:
                self.iterations, self._multi_in_flight = self.decode_steps, True
            return list(out.values())
        self.iterations = 1
        if self._multi_in_flight:  # [overlap] a multi-step row's tokens reach a K-step only
            decoding = [(r, end) for r, end in decoding if not r.num_pending]
        preemptions = self.num_preemptions
        # every decode row's pages in one allocation when nothing can be evicted or preempted
        # (the same pages as one grow after another); otherwise one by one, preempting
        together = self.speculative is None and len(decoding) > 1 \
            and self.manager.grow_rows(decoding)
        for req, end in decoding:
            if together:
                out[req.request_id] = self._decode_scheduled(req)
            elif req.status is RUNNING and (req.lease.grow(end)
                                            or self._grow_or_preempt(req, end)):
                if req.num_pending and self.speculative:  # [overlap] its last row in flight
                    chained = self.speculative.plan_chained(req)
                    if chained is not None:
                        out[req.request_id] = chained
                    continue
                verify = (self.speculative and not req.params.needs_history
                          and self.speculative.plan(req))
                out[req.request_id] = verify or self._decode_scheduled(req)
        budget = self.cfg.scheduler.chunked_prefill_size
        for req in prefilling:  # a preempted one is WAITING now
            if budget <= 0:
                break
            if req.status is RUNNING:
                budget = self._add_chunk(req, budget)
        if self.num_preemptions != preemptions:  # the running list changed: count again
            num_done = 0
            for r in self.running:
                if len(r.output_ids) + r.num_pending >= r.params.max_new_tokens:
                    num_done += 1
        max_running = self.cfg.scheduler.max_running_requests + num_done
        deferred = []
        pops = len(self.waiting)  # each waiting request is looked at once at most (no spin)
        while self.waiting and budget > 0 and len(self.running) < max_running:
            pops -= 1
            if pops < 0:
                raise RuntimeError(f"scheduler: admission looked at more requests than wait "
                                   f"({self.describe()})")
            req = self.waiting.popleft()
            if req.num_pending:  # [overlap] preempted with a token in flight: wait for it
                self.waiting.appendleft(req)
                break
            verdict = admit(self.manager, req, self.running, self.waiting)
            if verdict == "defer":
                deferred.append(req)
                continue
            if verdict == "full":
                self.waiting.appendleft(req)
                break
            req.status = RUNNING
            self.running.append(req)
            budget = self._add_chunk(req, budget)
            if req.status is not RUNNING:  # its first chunk did not fit: it waits again, and
                break  # admitting it again now would find the same pools (no spin)
        self.waiting.extendleft(reversed(deferred))
        if not out and self.manager.loads_in_flight():
            # [host tier] nothing else to run: the step waits for the loads it needs (on the
            # device: their scatters are dispatched, the host does not block)
            self.manager.land_loads()
            for req in self._load_waiters:
                if req.status is RUNNING and budget > 0:
                    budget = self._add_chunk(req, budget)
        self._load_waiters.clear()
        spec = self._spec
        for s in out.values():
            if s.spec is not None:
                continue  # a decode row built whole (``_decode_scheduled``)
            s.write_slot = s.write_slot or s.req.lease.running_slot
            # no verify row without speculative decoding: ``verifies`` not asked (per row)
            s.spec = self.speculative.verify_spec(s) if self.speculative is not None \
                and s.verifies else spec(s)
        if out:
            self._multi_in_flight = False
            if self.manager.loads_in_flight():  # [host tier] KV pages a row reads have landed
                self.manager.land_loads_read_by([s.spec for s in out.values()])
        if self.speculative is None:
            return list(out.values())
        rows = []
        for s in out.values():
            rows.append(s)
            for branch in s.branches:  # [speculative tree] a row per branch, after the first
                branch.spec = self.speculative.verify_spec(branch)
                rows.append(branch)
        return rows

    # ---- multi-step decode ---------------------------------------------------------------------
    def rewind(self, s: ScheduledSeq, j: int) -> None:
        """[multi-step decode] ``s``'s request stopped at its iteration ``j``: its lease counts
        the tokens through that iteration (``Lease.rewind``), before the finish inserts them."""
        lease, n = s.req.lease, s.start + j + 1
        if s.req.status is RUNNING and lease.num_computed != n:
            lease.rewind(n, s.snap_slot if s.snap_iter == j else lease.running_slot)

    def _add_chunk(self, req: Request, budget: int) -> int:
        """Schedule the next prefill chunk of ``req`` within ``budget``; the budget left."""
        start = req.lease.num_computed
        slot = req.lease.next_read_slot
        if self.manager.load_in_flight(slot) and \
                not self.manager.land_loads(upto=slot, ready_only=True):
            self._load_waiters.append(req)  # [host tier] runs once its load has landed
            self.manager.count_load_wait()
            return budget
        end = start + min(req.num_tokens - start, budget)
        if self.manager.grid:  # [deterministic, Pallas] cut on the grid (``prefill_end``)
            end = self.manager.prefill_end(start, end, req.prompt_len)
            if end == start:
                return budget
        if not self._grow_or_preempt(req, end):
            return budget
        self._out[req.request_id] = ScheduledSeq(req, start, end)
        return budget - (end - start)

    def _decode_scheduled(self, req: Request) -> ScheduledSeq:
        """A decode token. With pages, a step that ends on a page boundary writes its state to a
        fresh slot instead (``Lease.plan_decode_snapshot``): the next step reads it and writes
        the running slot again, so the newest page-aligned state survives to the finish."""
        lease = req.lease
        start = lease.num_computed
        s = ScheduledSeq(req, start, start + 1)
        if self.manager.boundary_snapshots:  # otherwise never one: no call per row
            slot = lease.plan_decode_snapshot(s.end)
            if slot is not None:
                s.write_slot = slot
        if lease.pending_snapshots and lease.plans(s.end):
            return s  # its spec once the step is decided (``_spec``)
        # No snapshot in the row (older planned ones lie before it): nothing later in the step
        # changes it (admissions plan snapshots for prefills only; a preemption drops the row),
        # so its spec is built now, without ``_spec``'s general path (per row of every step):
        # ``_spec``'s result.
        s.write_slot = write = lease.running_slot
        known = req.prompt_len + len(req.output_ids)
        if start < known:
            tokens, prev = req.token_slice(start, start + 1), -1
        elif start == known and req.num_pending == 1:  # [overlap] its token is on the device
            tokens, prev = PLACEHOLDER, req.pending_row
        else:
            return s  # ``_spec`` raises
        s.spec = SeqSpec(tokens, start, lease.page_ids, lease.next_read_slot, write, [], "last",
                         prev)
        return s

    def advance(self, seq: ScheduledSeq) -> None:
        """Record that ``seq`` ran (dispatched: later steps are ordered after it on the device);
        publish the prefill snapshots it wrote."""
        lease = seq.req.lease
        self.tokens_computed += seq.end - seq.start
        # once prefilled, ``prefill_done`` is not read: a decode row skips ``samples``
        if lease.written(seq.end, seq.write_slot, prefill_done=lease.prefilled or seq.samples):
            self._to_publish.append(seq.req)  # before the next admission (or at the finish)

    def accept_verify(self, s: ScheduledSeq, tokens: np.ndarray,
                      stops: Callable[[int], bool]) -> int:
        """[speculative] Record a verify row's outcome (``SpecDecoder.accept``); the number of
        tokens ``tokens[:e]`` to emit."""
        emitted = self.speculative.accept(s, tokens, stops)
        self.tokens_computed += emitted
        return emitted

    # ---- request ends ----------------------------------------------------------------------
    def release(self, req: Request, *, keep: bool) -> None:
        """Give back all ``req`` holds. ``keep``: insert its computed tokens and states first."""
        if req.status is not RUNNING:
            return
        self._out.pop(req.request_id, None)
        if self.speculative is not None:  # the lane goes; a scratch end state is copied
            self.speculative.release(
                req, end_snapshot=req.lease.keeps_end_snapshot(keep, req.prompt_len))
        req.lease.release(req, keep=keep)
        self.running.remove(req)

    def preempt(self, req: Request) -> None:
        """Put ``req``'s progress into the cache and requeue it at the front."""
        logging.vlog(1, "preempt request %d at %d/%d tokens", req.request_id, req.num_computed,
                     req.num_tokens)
        # [multi-step decode, overlap] tokens it computed are still in flight: nothing to keep
        self.release(req, keep=not (req.num_pending and self._multi_in_flight))
        req.status = WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def finish(self, req: Request, reason: str, *, keep: bool = True) -> None:
        """Insert what ``req`` computed (unless ``keep`` is False) and release it. [overlap] A
        request preempted while its token was in flight may finish waiting, when it is read."""
        if req.status is WAITING:
            self.waiting.remove(req)
        self.release(req, keep=keep)
        req.status = FINISHED
        req.finish_reason = reason
        self.num_finished += 1

    def drop_all(self, victims: list[Request]) -> None:
        """The pools are lost: ``victims`` (every running request and every waiting one with a
        token in flight) leave the queues as failed, their leases forgotten; the cache starts
        empty and the speculative lanes are free."""
        for req in victims:
            queue = self.running if req.status is RUNNING else self.waiting
            queue.remove(req)
            req.lease.abandon()
            self.num_finished += 1
            req.status, req.finish_reason = FINISHED, "error"
        self._to_publish.clear()
        self.manager.reset()
        if self.speculative is not None:
            self.speculative.reset()

    # ---- liveness and checks ---------------------------------------------------------------
    def token_read(self, req: Request, count: int = 1) -> None:
        """[overlap] The ``count`` tokens a dispatched row sampled for ``req`` were read (and
        appended)."""
        req.pending_read(count)
        self.tokens_read += count

    def progress_marker(self) -> tuple[int, int, int]:
        """Changes iff a step computed a token, a sampled token was read or a request finished."""
        return self.tokens_computed, self.num_finished, self.tokens_read

    def describe(self) -> str:
        """The stuck state, for the no-progress error."""
        run = [f"{r.request_id} ({r.num_computed}/{r.num_tokens} tokens, "
               f"{len(r.lease.page_ids)} pages)" for r in self.running]
        wait = [f"{r.request_id} ({r.num_tokens} tokens)" for r in list(self.waiting)[:8]]
        return (f"running [{', '.join(run)}]; waiting {len(self.waiting)} [{', '.join(wait)}]; "
                f"{self.manager.describe()}")

    def check_step(self, scheduled: list[ScheduledSeq]) -> None:
        """Raise if this step breaks an invariant of the module docstring."""
        self.manager.check_step(scheduled)

    def check(self) -> None:
        """Raise if the cache, the leases or (speculative) the scratch lanes are inconsistent."""
        self.manager.check(self.running, self.waiting)
        if self.speculative is not None:
            self.speculative.check_lanes(self.running, self.manager.tree_slots())
