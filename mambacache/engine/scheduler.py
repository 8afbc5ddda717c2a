"""Continuous batching: admission, chunked prefill, decode, preemption, and the cache lifecycle.

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
  3. decode one token per step (only once the prefill is done: ``Request.prefilled``);
  4. when a request cannot grow, the newest running request is preempted (its progress goes into
     the cache) until it can; the oldest request always progresses, so every configuration does;
  5. finish: insert everything computed, with the running slot as the end snapshot.

Host only: no JAX here (the simulator drives this same class with the shadow runner).
Invariants of a step (``check_step``, run under ``scheduler.check_integrity_every_step``): no row
reads a FREE slot; no slot or page is written by one row and read or written by another; every
slot a row reads is locked in the tree or held by the reading request.
"""

from __future__ import annotations

import collections

import numpy as np
from absl import logging

from mambacache.config import EngineConfig
from mambacache.engine.admission import NO_PAGES, admit
from mambacache.engine.request import Request, Status
from mambacache.engine.speculative import SpecDecoder
from mambacache.engine.step_checks import check_step
from mambacache.engine.step_plan import ScheduledSeq, SeqSpec

__all__ = ["ScheduledSeq", "Scheduler"]


class Scheduler:
    def __init__(self, cfg: EngineConfig, cache):
        self.cfg = cfg
        self.cache = cache
        self.page_size = cfg.cache.page_size
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.tokens_computed = 0  # progress: tokens fed through the model, all requests
        self.num_finished = 0  # progress: requests finished (any reason)
        self.tokens_read = 0  # progress [overlap]: sampled tokens read one step late
        self._out: dict[int, ScheduledSeq] = {}
        self._to_publish: list[Request] = []  # prefills whose last step wrote snapshots
        # [speculative] verify rows instead of decodes when a drafter proposes tokens
        self.speculative = SpecDecoder(cfg) if cfg.speculative.enabled else None

    # ---- pages -----------------------------------------------------------------------------
    def _grow(self, req: Request, end: int) -> bool:
        """Make ``req``'s pages cover ``end`` tokens; False if the pool cannot (nothing taken)."""
        need = -(-end // self.page_size) - len(req.cached_page_ids) - len(req.own_page_ids)
        if need <= 0:
            return True
        pages = self.cache.alloc_pages(need)
        if pages is None:
            return False
        req.own_page_ids = np.concatenate([req.own_page_ids, pages]) if len(req.own_page_ids) \
            else pages
        return True

    def _grow_or_preempt(self, req: Request, end: int) -> bool:
        """Grow ``req`` to ``end`` tokens, preempting the newest running request until it fits;
        False if ``req`` itself was the newest and was preempted."""
        while not self._grow(req, end):
            victim = self.running[-1]
            self.preempt(victim)
            if victim is req:
                return False
        return True

    def _spec(self, s: ScheduledSeq) -> SeqSpec:
        req, start, end = s.req, s.start, s.end
        planned = [(pos, slot) for pos, slot in sorted(req.pending_snapshots.items())
                   if start < pos <= end]
        if planned:
            req.snapshots_in_flight.update([pos for pos, _ in planned])
        # A snapshot that IS the step's final state is its write slot (no extra row target),
        # so a page-boundary decode keeps the decode program.
        snaps = [(pos - start, slot) for pos, slot in planned
                 if not (pos == end and slot == s.write_slot)]
        read = req.state_slot if req.state_valid else (req.read_slot or 0)
        tokens, prev = req.token_slice(start, end), -1
        if start + len(tokens) < end:  # [overlap] the last token is still on the device
            if req.num_pending != 1 or start + len(tokens) + 1 != end:
                raise AssertionError(f"request {req.request_id}: row [{start}, {end}) needs "
                                     f"{req.num_pending} pending tokens")
            tokens, prev = np.append(tokens, np.int32(0)), req.pending_row
        return SeqSpec(tokens=tokens, prefix_len=start, page_ids=req.page_ids, prev_index=prev,
                       read_slot=read, write_slot=s.write_slot, snapshots=snaps)

    # ---- one step --------------------------------------------------------------------------
    def schedule(self) -> list[ScheduledSeq]:
        """Choose this step's work: decodes, running prefill chunks, then new admissions."""
        self._out = out = {}
        for req in self._to_publish:
            if req.status is Status.RUNNING:
                self._publish(req, final=req.prefilled)
        self._to_publish.clear()
        for req in [r for r in self.running if r.prefilled]:
            if req.num_outputs >= req.params.max_new_tokens:
                continue  # [overlap] its last token is in flight: it finishes when read
            if req.status is Status.RUNNING and self._grow_or_preempt(req, req.num_tokens):
                verify = self.speculative and self.speculative.plan(self, req)
                out[req.request_id] = verify or self._decode_scheduled(req)
        budget = self.cfg.scheduler.chunked_prefill_size
        for req in [r for r in self.running if not r.prefilled]:
            if budget <= 0:
                break
            if req.status is Status.RUNNING:
                budget = self._add_chunk(req, budget)
        # [overlap] a request whose last token is in flight takes no row: it does not count
        max_running = self.cfg.scheduler.max_running_requests + sum(
            r.num_outputs >= r.params.max_new_tokens for r in self.running)
        deferred = []
        while self.waiting and budget > 0 and len(self.running) < max_running:
            req = self.waiting.popleft()
            if req.num_pending:  # [overlap] preempted with a token in flight: wait for it
                self.waiting.appendleft(req)
                break
            verdict = admit(self, req)
            if verdict == "defer":
                deferred.append(req)
                continue
            if verdict == "full":
                self.waiting.appendleft(req)
                break
            budget = self._add_chunk(req, budget)
        self.waiting.extendleft(reversed(deferred))
        for s in out.values():
            s.write_slot = s.write_slot or s.req.running_slot
            s.spec = self.speculative.verify_spec(s) if s.drafts else self._spec(s)
        return list(out.values())

    def _add_chunk(self, req: Request, budget: int) -> int:
        """Schedule the next prefill chunk of ``req`` within ``budget``; the budget left."""
        end = req.num_computed + min(req.num_remaining, budget)
        if not self._grow_or_preempt(req, end):
            return budget
        self._out[req.request_id] = ScheduledSeq(req, req.num_computed, end)
        return budget - (end - req.num_computed)

    def _decode_scheduled(self, req: Request) -> ScheduledSeq:
        """A decode token. With pages, a step that ends on a page boundary writes its state to a
        fresh slot instead (a snapshot without a copy): the next step reads it and writes the
        running slot again, so the newest page-aligned state survives to the finish. The previous
        such snapshot is given back (no row of this step reads it: the step reads the state
        written by the step before, in the running slot)."""
        s = ScheduledSeq(req, req.num_computed, req.num_computed + 1)
        if self.page_size == 1 or s.end % self.page_size or not self.cfg.cache.enable:
            return s
        got = self.cache.alloc_slots(1)
        if got is None:
            self.cache.record_skipped()
            return s
        stale = [slot for pos, slot in req.pending_snapshots.items() if pos < s.end]
        if stale:
            self.cache.free_slots(stale)
        req.pending_snapshots = {s.end: int(got[0])}
        req.snapshots_in_flight = set()
        s.write_slot = int(got[0])
        return s

    def advance(self, seq: ScheduledSeq) -> None:
        """Record that ``seq`` ran (dispatched: later steps are ordered after it on the device);
        publish the prefill snapshots it wrote."""
        req = seq.req
        req.num_computed = seq.end
        req.state_valid = True
        req.state_slot = seq.write_slot
        self.tokens_computed += seq.end - seq.start
        if not req.prefilled:
            req.prefilled = seq.samples
            if req.pending_snapshots:
                self._to_publish.append(req)  # before the next admission (or at the finish)

    # ---- cache lifecycle -------------------------------------------------------------------
    def _written_snapshots(self, req: Request, *, drop_rest: bool) -> dict[int, int]:
        """Pending snapshots a step has written, removed from ``pending_snapshots``; with
        ``drop_rest`` the others are freed too."""
        done = {p: s for p, s in req.pending_snapshots.items() if p in req.snapshots_in_flight
                and p <= req.num_computed}
        rest = {p: s for p, s in req.pending_snapshots.items() if p not in done}
        if drop_rest and rest:
            self.cache.free_slots(list(rest.values()))  # a list: no numpy for a few ids
            rest = {}
        req.pending_snapshots = rest
        req.snapshots_in_flight -= done.keys()
        return done

    def _publish(self, req: Request, *, final: bool) -> None:
        """Insert the prefix up to the deepest written prefill snapshot, mid-flight.

        The tree keeps KV only up to its deepest state, so exactly that prefix is inserted; the
        request switches to the tree's pages for it (its own duplicates were freed) and moves its
        lock to the new node. The slots offered are snapshot slots only, never one the request
        reads, so a slot the tree rejects (and frees) is referenced by no one.
        """
        snaps = self._written_snapshots(req, drop_rest=final)
        if not snaps:
            return
        if req.state_slot in snaps.values() or req.running_slot in snaps.values():
            raise AssertionError(f"request {req.request_id} offers its running state to the tree")
        n = max(snaps)
        num_pages = n // self.page_size
        pages = req.page_ids
        res = self.cache.insert(req.token_slice(0, n), pages[:num_pages], snapshots=snaps,
                                extra_key=req.extra_key)
        if res.kept_len // self.page_size != num_pages:
            raise AssertionError(f"insert kept {res.kept_len} of {n} tokens of a running request")
        self.cache.lock(res.node)
        self.cache.unlock(req.match_node)
        req.match_node = res.node
        req.cached_page_ids = np.asarray(res.page_ids, np.int32)
        req.own_page_ids = pages[num_pages:]

    def release(self, req: Request, *, keep: bool) -> None:
        """Give back all ``req`` holds. ``keep``: insert its computed tokens and states first."""
        if req.status is not Status.RUNNING:
            return
        self._out.pop(req.request_id, None)
        snaps = self._written_snapshots(req, drop_rest=True)
        slot = req.running_slot
        n = req.num_computed
        end_snapshot = keep and req.state_valid and n % self.page_size == 0 and n not in snaps
        if self.speculative is not None:  # the lane goes; a scratch end state is copied
            self.speculative.release(req, end_snapshot=end_snapshot)
        if end_snapshot:
            snaps[n] = slot
        elif slot is not None:
            self.cache.free_slots([slot])
        pages = req.page_ids
        num_cached = len(req.cached_page_ids)
        used = max(-(-n // self.page_size), num_cached) if keep else num_cached
        if len(pages) > used:  # pages taken for tokens that were never computed
            self.cache.free_pages(pages[used:])
        if keep:
            self.cache.insert(req.token_slice(0, n), pages[:used], snapshots=snaps,
                              extra_key=req.extra_key)
        elif snaps:
            self.cache.free_slots(list(snaps.values()))
        self.cache.unlock(req.match_node)
        req.match_node, req.running_slot, req.read_slot, req.state_slot = None, None, None, None
        req.own_page_ids = req.cached_page_ids = NO_PAGES
        req.state_valid = req.prefilled = False
        self.running.remove(req)

    def preempt(self, req: Request) -> None:
        """Put ``req``'s progress into the cache and requeue it at the front."""
        logging.vlog(1, "preempt request %d at %d/%d tokens", req.request_id, req.num_computed,
                     req.num_tokens)
        self.release(req, keep=True)
        req.status = Status.WAITING
        req.num_computed = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def finish(self, req: Request, reason: str, *, keep: bool = True) -> None:
        """Insert what ``req`` computed (unless ``keep`` is False) and release it. [overlap] A
        request preempted while its token was in flight may finish waiting, when it is read."""
        if req.status is Status.WAITING:
            self.waiting.remove(req)
        self.release(req, keep=keep)
        req.status = Status.FINISHED
        req.finish_reason = reason
        self.num_finished += 1

    # ---- liveness and checks ---------------------------------------------------------------
    def token_read(self, req: Request) -> None:
        """[overlap] The token a dispatched row sampled for ``req`` was read (and appended)."""
        req.num_pending -= 1
        self.tokens_read += 1

    def progress_marker(self) -> tuple[int, int, int]:
        """Changes iff a step computed a token, a sampled token was read or a request finished."""
        return self.tokens_computed, self.num_finished, self.tokens_read

    def describe(self) -> str:
        """The stuck state, for the no-progress error."""
        run = [f"{r.request_id} ({r.num_computed}/{r.num_tokens} tokens, "
               f"{len(r.page_ids)} pages)" for r in self.running]
        wait = [f"{r.request_id} ({r.num_tokens} tokens)" for r in list(self.waiting)[:8]]
        c = self.cache
        return (f"running [{', '.join(run)}]; waiting {len(self.waiting)} [{', '.join(wait)}]; "
                f"pages available {c.available_pages()} of {c.pages.num_ids} "
                f"(locked {c.locked_pages()}); slots available {c.available_slots()} of "
                f"{c.slots.num_ids} (locked {c.locked_slots()})")

    def check_step(self, scheduled: list[ScheduledSeq]) -> None:
        """Raise if this step breaks an invariant of the module docstring."""
        check_step(self.cache, scheduled, self.page_size)

