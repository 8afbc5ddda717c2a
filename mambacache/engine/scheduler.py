"""Continuous batching: admission, chunked prefill, decode, preemption, and the cache lifecycle.

One step mixes decode tokens (every running request past its prefill) with prefill chunks
(``chunked_prefill_size`` tokens in all). Per request, in order:
  1. admit: match the prefix, lock the matched node, take one running slot, plan snapshots;
  2. run chunks; the first reads the cached state (``read_slot``), every chunk writes the
     running slot; planned snapshots are taken inside the chunk that covers their position;
  3. when the prefill completes, insert the prefix and its snapshots so that others hit it;
  4. decode one token per step; when KV runs out, preempt the newest request (its progress goes
     into the cache) and requeue it;
  5. finish: insert everything computed, with the running slot as the end snapshot.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from mambacache.engine.batch import SeqSpec
from mambacache.config import EngineConfig
from mambacache.engine.request import Request, Status
from mambacache.cache.snapshot_plan import assign_snapshot_slots, plan_snapshots


@dataclasses.dataclass
class ScheduledSeq:
    """One request's part of a step: tokens ``[start, end)`` of ``req.token_ids``.

    ``spec`` is built once the whole step is decided (admissions may still add snapshots to
    requests scheduled earlier in the same step).
    """

    req: Request
    start: int
    end: int
    spec: SeqSpec | None = None
    write_slot: int | None = None  # where the step leaves the state (running slot by default)

    @property
    def samples(self) -> bool:
        """The chunk reaches the request's last token, so its logits give the next token."""
        return self.end == self.req.num_tokens


class Scheduler:
    def __init__(self, cfg: EngineConfig, cache):
        self.cfg = cfg
        self.cache = cache
        self.page_size = cfg.cache.page_size
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    # ---- admission -------------------------------------------------------------------------
    def _inflight_branch(self, req: Request, cached_len: int, branch_len: int) -> int | None:
        """In-batch dedup against running requests that share an uncached prefix with ``req``.

        Returns ``None`` if ``req`` should wait: a running prefill has not yet passed the common
        prefix, so it also plans a snapshot there and ``req`` will hit it once inserted.
        Otherwise the branch position to plan for ``req``: past ``branch_len`` when a running
        request computed the common prefix already (both diverge there, neither had it cached).
        """
        if not self.cfg.cache.enable:
            return branch_len
        tokens = req.token_ids
        for other in self.running:
            if other.extra_key != req.extra_key:
                continue
            theirs = other.token_ids
            n = min(len(tokens), len(theirs))
            diff = np.flatnonzero(tokens[:n] != theirs[:n])
            common = int(diff[0]) if diff.size else n
            common = min(common, len(tokens) - 1) // self.page_size * self.page_size
            if common <= cached_len:
                continue
            if common <= other.num_computed or other.prefix_inserted:
                branch_len = max(branch_len, common)
                continue
            if common not in other.pending_snapshots and common < other.num_tokens:
                slots = self.cache.alloc_slots(1)
                if slots is not None:
                    other.pending_snapshots[common] = int(slots[0])
            return None
        return branch_len

    def _admit(self, req: Request) -> str:
        """Try to start ``req``: "ok", "defer" (dedup: wait for a running prefill) or "full"
        (back-pressure). Nothing is held unless "ok"."""
        tokens = req.token_ids
        m = self.cache.match_prefix(tokens, extra_key=req.extra_key)
        branch_len = self._inflight_branch(req, m.cached_len, m.branch_len)
        if branch_len is None:
            return "defer"
        need_pages = -(-len(tokens) // self.page_size) - m.cached_len // self.page_size
        if self.cache.available_pages() < need_pages or self.cache.available_slots() < 1:
            return "full"
        self.cache.lock(m.node)
        slots = self.cache.alloc_slots(1)
        if slots is None:
            self.cache.unlock(m.node)
            return "full"
        req.match_node, req.read_slot, req.running_slot = m.node, m.read_slot, int(slots[0])
        req.cached_page_ids = np.asarray(m.page_ids, np.int32)
        req.own_page_ids = []
        req.num_computed = m.cached_len
        if req.num_preemptions == 0:
            req.cached_tokens = m.cached_len
        req.prefix_inserted = False
        if self.cfg.cache.enable:
            positions = plan_snapshots(len(tokens), m.cached_len, branch_len, self.page_size,
                                       self.cfg.cache.checkpoint_interval)
            req.pending_snapshots = assign_snapshot_slots(self.cache, positions, branch_len,
                                                          len(tokens), self.page_size)
        req.status = Status.RUNNING
        req.state_valid = False
        self.running.append(req)
        return "ok"

    # ---- pages -----------------------------------------------------------------------------
    def _grow(self, req: Request, end: int) -> bool:
        """Make ``req``'s pages cover ``end`` tokens; False if the pool cannot (nothing taken)."""
        need = -(-end // self.page_size) - len(req.cached_page_ids) - len(req.own_page_ids)
        if need <= 0:
            return True
        pages = self.cache.alloc_pages(need)
        if pages is None:
            return False
        req.own_page_ids.extend(int(p) for p in pages)
        return True

    def _spec(self, req: Request, start: int, end: int, write_slot: int) -> SeqSpec:
        snaps = [(pos - start, slot) for pos, slot in sorted(req.pending_snapshots.items())
                 if start < pos <= end]
        req.snapshots_in_flight.update(start + off for off, _ in snaps)
        read = req.state_slot if req.state_valid else (req.read_slot or 0)
        return SeqSpec(tokens=req.token_ids[start:end], prefix_len=start, page_ids=req.page_ids,
                       read_slot=read, write_slot=write_slot, snapshots=snaps)

    # ---- one step --------------------------------------------------------------------------
    def schedule(self) -> list[ScheduledSeq]:
        """Choose this step's work: decodes, running prefill chunks, then new admissions."""
        out: dict[int, ScheduledSeq] = {}
        for req in [r for r in self.running if r.num_remaining == 1]:
            if req.status is not Status.RUNNING:
                continue  # preempted by an earlier request of this loop
            while not self._grow(req, req.num_tokens):
                victim = self.running[-1]
                self.preempt(victim)
                out.pop(victim.request_id, None)
                if victim is req:
                    break
            else:
                out[req.request_id] = self._decode_scheduled(req)
        budget = self.cfg.scheduler.chunked_prefill_size
        for req in [r for r in self.running if r.num_remaining > 1]:
            if budget <= 0:
                break
            budget = self._add_chunk(req, budget, out)
        max_running = self.cfg.scheduler.max_running_requests
        deferred = []
        while self.waiting and budget > 0 and len(self.running) < max_running:
            req = self.waiting.popleft()
            verdict = self._admit(req)
            if verdict == "defer":
                deferred.append(req)
                continue
            if verdict == "full":
                self.waiting.appendleft(req)
                break
            budget = self._add_chunk(req, budget, out)
        self.waiting.extendleft(reversed(deferred))
        for s in out.values():
            s.write_slot = s.write_slot or s.req.running_slot
            s.spec = self._spec(s.req, s.start, s.end, s.write_slot)
        return list(out.values())

    def _add_chunk(self, req: Request, budget: int, out: dict[int, ScheduledSeq]) -> int:
        """Schedule the next prefill chunk of ``req`` within ``budget``; the budget left."""
        end = req.num_computed + min(req.num_remaining, budget)
        if not self._grow(req, end):
            return budget  # the pool is short: the request waits for pages
        out[req.request_id] = self._scheduled(req, end)
        return budget - (end - req.num_computed)

    def _scheduled(self, req: Request, end: int) -> ScheduledSeq:
        return ScheduledSeq(req, req.num_computed, end)

    def _decode_scheduled(self, req: Request) -> ScheduledSeq:
        """A decode token. With pages, a step that ends on a page boundary writes its state to a
        fresh slot instead (a snapshot without a copy): the next step reads it and writes the
        running slot again, so the newest page-aligned state survives to the finish. The previous
        such snapshot is given back."""
        s = self._scheduled(req, req.num_computed + 1)
        if self.page_size == 1 or s.end % self.page_size or not self.cfg.cache.enable:
            return s
        got = self.cache.alloc_slots(1)
        if got is None:
            self.cache.record_skipped()
            return s
        stale = [slot for pos, slot in req.pending_snapshots.items() if pos < s.end]
        if stale:
            self.cache.free_slots(np.asarray(stale, np.int32))
        req.pending_snapshots = {s.end: int(got[0])}
        req.snapshots_in_flight = {s.end}
        s.write_slot = int(got[0])
        return s

    def advance(self, seq: ScheduledSeq) -> None:
        """Record that ``seq`` ran: its state is in the running slot, its KV in its pages."""
        req = seq.req
        req.num_computed = seq.end
        req.state_valid = True
        req.state_slot = seq.write_slot
        finishes_prefill = seq.samples and (seq.start < req.prompt_len or seq.end - seq.start > 1)
        if finishes_prefill and not req.prefix_inserted and req.pending_snapshots:
            self.insert_prefix(req)

    # ---- cache lifecycle -------------------------------------------------------------------
    def _written_snapshots(self, req: Request) -> dict[int, int]:
        """Pending snapshots that a step has written; the others' slots are freed."""
        done = {p: s for p, s in req.pending_snapshots.items() if p in req.snapshots_in_flight
                and p <= req.num_computed}
        unwritten = [s for p, s in req.pending_snapshots.items() if p not in done]
        if unwritten:
            self.cache.free_slots(np.asarray(unwritten, np.int32))
        req.pending_snapshots = {}
        req.snapshots_in_flight = set()
        return done

    def insert_prefix(self, req: Request) -> None:
        """Step 3: publish the prefix up to the deepest planned snapshot, mid-flight.

        The tree keeps KV only up to its deepest state, so exactly that prefix is inserted; the
        request switches to the tree's pages for it (its own duplicates were freed) and moves its
        lock to the new node.
        """
        snaps = self._written_snapshots(req)
        if not snaps:
            return
        n = max(snaps)
        num_pages = n // self.page_size
        pages = req.page_ids
        res = self.cache.insert(req.token_ids[:n], pages[:num_pages], snapshots=snaps,
                                extra_key=req.extra_key)
        kept_pages = res.kept_len // self.page_size
        if kept_pages != num_pages:
            raise AssertionError(f"insert kept {res.kept_len} of {n} tokens of a running request")
        self.cache.lock(res.node)
        self.cache.unlock(req.match_node)
        req.match_node = res.node
        req.cached_page_ids = np.asarray(res.page_ids, np.int32)
        req.own_page_ids = [int(p) for p in pages[num_pages:]]
        req.prefix_inserted = True

    def release(self, req: Request, *, keep: bool) -> None:
        """Give back all ``req`` holds. ``keep``: insert its computed tokens and states first."""
        if req.status is not Status.RUNNING:
            return
        snaps = self._written_snapshots(req)
        slot = req.running_slot
        n = req.num_computed
        if keep and req.state_valid and n % self.page_size == 0 and n not in snaps:
            snaps[n] = slot
        elif slot is not None:
            self.cache.free_slots(np.asarray([slot], np.int32))
        pages = req.page_ids
        num_cached = len(req.cached_page_ids)
        used = max(-(-n // self.page_size), num_cached) if keep else num_cached
        if len(pages) > used:  # pages taken for tokens that were never computed
            self.cache.free_pages(pages[used:])
        if keep:
            self.cache.insert(req.token_ids[:n], pages[:used], snapshots=snaps,
                              extra_key=req.extra_key)
        elif snaps:
            self.cache.free_slots(np.asarray(list(snaps.values()), np.int32))
        self.cache.unlock(req.match_node)
        req.match_node, req.running_slot, req.read_slot, req.state_slot = None, None, None, None
        req.own_page_ids, req.cached_page_ids = [], np.zeros(0, np.int32)
        req.state_valid = False
        self.running.remove(req)

    def preempt(self, req: Request) -> None:
        """Step 4: put ``req``'s progress into the cache and requeue it at the front."""
        self.release(req, keep=True)
        req.status = Status.WAITING
        req.num_computed = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def finish(self, req: Request, reason: str, *, keep: bool = True) -> None:
        """Step 5: insert what ``req`` computed (unless ``keep`` is False) and release it."""
        self.release(req, keep=keep)
        req.status = Status.FINISHED
        req.finish_reason = reason
