"""Speculative decoding on the host: verify rows, scratch lanes, acceptance and rollback by slot.

A request past its prefill whose drafter proposes ``m`` (1..k) tokens runs a *verify row*
instead of a decode: the extend ``[last token, d_1..d_m]`` with logits at every position. The
state after each offset ``j`` (1..m+1) goes to its own slot: the request's running slot and the
``k + 1`` scratch slots of its *lane* minus the slot the row reads, so no slot is read and
written by the same row. After the step, the target's tokens ``t_0..t_m`` (one per position,
sampled with the request's own per-output-index key) are compared with the drafts: ``a`` drafts
are accepted while ``d_j == t_{j-1}``, and ``t_0..t_a`` are emitted (cut at a stop). The state
after the emitted ``e`` tokens is simply the one at offset ``e``: the request reads that slot next
(rollback by slot choice, no copy). Rejected positions' KV stays in the request's own pages and
is overwritten by the next extend before anything reads it.

Invariants (``check_lanes``; the data-flow oracle ``ShadowRunner`` checks the reads):
  * scratch slots are ids ``num_mamba_slots + 1 ..`` of the pools, never the cache allocator's:
    ``max_running_requests`` lanes of ``topk * (k + 1)`` (``topk`` > 1: draft trees,
    ``engine/speculative/tree.py``, one verify row per branch); a running request holds at most one
    lane (``Lease.scratch_slots``), released with the request;
  * the tree only ever sees verified tokens: ``Request.token_ids`` grows by accepted tokens
    only, and a page-boundary snapshot planned inside a verify window is kept only if that
    position was accepted (freed otherwise);
  * a request that ends with its state in a scratch slot and inserts an end snapshot gets it
    copied into its running slot (``slot_copies``, run by the engine before the next step and
    ordered by the pools' data dependency) -- the only copy, once per request end.

Drafts are deterministic (one-hot draft distribution), so "sample ``t_j`` from the target,
accept while it equals the draft" is exact rejection sampling: outputs are the target's, and a
seeded request samples the very tokens it would without speculation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from mambacache.config import EngineConfig
from mambacache.engine.speculative.chain import Chain, targets
from mambacache.engine.speculative.drafters import make_drafter
from mambacache.engine.speculative.tree import page_copies, pick_branch, plan_tree, row_pages
from mambacache.engine.step.plan import ScheduledSeq, SeqSpec

if TYPE_CHECKING:
    from mambacache.engine.request import Request


def lane_width(cfg: EngineConfig) -> int:
    """Scratch slots of one lane: ``topk * (k + 1)`` (every branch's offsets)."""
    spec = cfg.speculative
    return spec.topk * (spec.num_draft_tokens + 1)


def max_rows(cfg: EngineConfig) -> int:
    """Most rows of a step: a request's tree takes one per branch (``topk``)."""
    spec = cfg.speculative
    return cfg.scheduler.max_running_requests * (spec.topk if spec.enabled else 1)


def num_state_slots(cfg: EngineConfig) -> int:
    """Usable state slots of the pools: the cache's plus the speculative scratch lanes."""
    lanes = cfg.scheduler.max_running_requests if cfg.speculative.enabled else 0
    return cfg.cache.num_mamba_slots + lanes * lane_width(cfg)


class SpecDecoder:
    """Plans verify rows, owns the scratch lanes and the speculative counters."""

    def __init__(self, cfg: EngineConfig):
        self.k = cfg.speculative.num_draft_tokens
        self.topk = cfg.speculative.topk
        self.width = lane_width(cfg)  # scratch slots per lane
        self.adaptive = cfg.speculative.adaptive
        self._budget: dict[int, int] = {}  # request id -> drafts its next verify may propose
        self.drafter = make_drafter(cfg.speculative)
        self.chain_room = cfg.speculative.method == "mtp"
        self.scratch_base = cfg.cache.num_mamba_slots + 1
        self.page_size = cfg.cache.page_size
        self.num_lanes = cfg.scheduler.max_running_requests
        self._free_lanes = list(range(self.num_lanes - 1, -1, -1))
        self.slot_copies: list[tuple[int, int]] = []  # (src scratch, dst running) pending
        self.verify_steps = self.draft_tokens = self.accepted_tokens = self.emitted_tokens = 0
        self.verify_rows = self.verify_tokens = 0  # rows (tree: one per branch), their tokens
        self.branch_wins = 0  # [tree] verifies that followed a branch other than the first
        # [overlap] request id -> (its sampling row in the step dispatched last, row index)
        self.flying: dict[int, tuple[ScheduledSeq, int]] = {}
        self.last_accepted = 0  # drafts the last ``accept`` accepted

    # ---- lanes -----------------------------------------------------------------------------
    def _lane_slots(self, lane: int) -> tuple[int, ...]:
        first = self.scratch_base + lane * self.width
        return tuple(range(first, first + self.width))

    def _take_lane(self, req: Request) -> None:
        if not req.lease.scratch_slots:
            lane = self._free_lanes.pop()  # lanes = max_running_requests: never short
            req.lease.take_lane(self._lane_slots(lane))

    def free_lanes(self) -> list[int]:
        """The lanes no request holds (sorted)."""
        return sorted(self._free_lanes)

    def release(self, req: Request, *, end_snapshot: bool) -> None:
        """``req`` gives back everything (finish, abort, preemption). ``end_snapshot``: its
        running slot becomes the end state in the tree, so a scratch state is copied there."""
        self._budget.pop(req.request_id, None)
        self.flying.pop(req.request_id, None)
        self.drafter.forget(req.request_id)
        lease = req.lease
        if not lease.scratch_slots:
            return
        if end_snapshot and lease.state_slot in lease.scratch_slots:
            self.slot_copies.append((lease.state_slot, lease.running_slot))
        lane = lease.drop_lane()
        self._free_lanes.append((lane[0] - self.scratch_base) // self.width)

    def reset(self) -> None:
        """The pools are gone (a failed step consumed them): every lane is free again."""
        self._free_lanes = list(range(self.num_lanes - 1, -1, -1))
        self.slot_copies.clear()
        self._budget.clear()
        self.flying.clear()

    def page_copies(self, scheduled: Sequence[ScheduledSeq]) -> list[tuple[int, int]]:
        """[tree, page size > 1] KV pages to copy before ``scheduled`` runs
        (``speculative.tree.page_copies``)."""
        if self.topk == 1 or self.page_size == 1:
            return []
        return page_copies(scheduled, self.page_size)

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.slot_copies = self.slot_copies, []
        return copies

    # ---- planning --------------------------------------------------------------------------
    def plan(self, req: Request) -> ScheduledSeq | None:
        """A verify row for ``req`` (prefilled, pages grown to ``num_tokens``), or None for a
        plain decode: no draft, or no room (drafts never preempt: they use pages the request
        can get without it)."""
        remaining = req.params.max_new_tokens - len(req.output_ids)
        budget = min(self._budget.get(req.request_id, self.k), remaining - 1)
        if self.topk > 1:
            tree = self.drafter.propose_tree_for(req, budget, self.topk)
            if len(tree) > 1:
                s = self._plan_tree(req, tree)
                if s is not None:
                    return s
            drafts = tree[0] if tree else []
        else:
            drafts = self.drafter.propose_for(req, budget)
        start, lease = req.num_computed, req.lease
        if drafts and self.chain_room:  # [mtp] room for the chained drafts' K/V if free
            lease.grow(start + 1 + len(drafts) + self.k - 1)
        if drafts and not lease.grow(start + 1 + len(drafts)):
            drafts = drafts[:max(lease.room(start + 1), 0)]
        if not drafts:
            return None
        self._take_lane(req)
        m = len(drafts)
        targets = [s for s in (lease.running_slot, *lease.scratch_slots)
                   if s != lease.state_slot]
        s = ScheduledSeq(req, start, start + 1, write_slot=targets[m])
        s.drafts, s.targets = tuple(drafts), tuple(targets[:m + 1])
        lease.plan_window_snapshots(start + 1, start + m + 2)
        return s

    def _plan_tree(self, req: Request, tree: list[list[int]]) -> ScheduledSeq | None:
        """The rows of a draft tree (``speculative.tree.plan_tree``), or None: the caller verifies
        the first branch as a chain."""
        mtp_room = self.k - 1 if self.chain_room else 0
        return plan_tree(req, tree, mtp_room, self.page_size, lambda: self._take_lane(req))

    def plan_chained(self, req: Request) -> ScheduledSeq | None:
        """[overlap, drafts on the device] The row of ``req`` whose previous row (in the step
        in flight) is not read yet (``engine/speculative/chain.py``), planned as if that row accepts
        all its drafts; None if the pages for it are not free (drafts never preempt; the
        request waits for the read). A host drafter's request never gets here: the step loop
        reads its previous row first (``StepLoop._drafts_need_tokens``)."""
        if not self.drafter.on_device:
            raise AssertionError(f"request {req.request_id}: a chained row needs drafts made "
                                 f"on the device, not by {type(self.drafter).__name__}")
        prev, b = self.flying[req.request_id]
        lease = req.lease
        if prev.verifies:  # its progress is recorded when read: ``prev.start`` is the lease's
            m, cand = len(prev.drafts), prev.targets[:len(prev.drafts) + 1]
            start = prev.start + m + 1
        else:  # a decode or a prefill's last chunk: recorded at dispatch
            m, cand, start = 0, (lease.state_slot,), prev.end
        left = req.params.max_new_tokens - len(req.output_ids) - (m + 1)
        n = max(0, min(self._budget.get(req.request_id, self.k), left - 1))
        if not lease.grow(start + 1):
            return None
        lease.grow(start + 1 + n + self.k - 1)  # room for the chained drafts' K/V if free
        if not lease.grow(start + 1 + n):
            n = max(min(n, lease.room(start + 1)), 0)
        self._take_lane(req)
        pool = (lease.running_slot, *lease.scratch_slots)
        tg = targets(pool, cand[m], n + 1)
        s = ScheduledSeq(req, start, start + 1, write_slot=tg[n])
        s.drafts, s.targets = (0,) * n, tg
        s.chain = Chain(src=b, base=m, cand=tuple(cand), pool=pool, ndraft=n)
        return s

    def dispatched(self, scheduled: Sequence[ScheduledSeq]) -> None:
        """[overlap] Remember each request's sampling row in the step just dispatched."""
        self.flying = {s.req.request_id: (s, b) for b, s in enumerate(scheduled)
                       if (s.verifies or s.samples) and not s.branch}

    def resolve(self, req: Request, accepted: int, bonus: int, mtp_drafts: Any) -> None:
        """[overlap] ``req``'s row before its chained one was read (``accepted`` drafts, then
        ``bonus``; ``mtp_drafts``: the head's drafts for it): make the chained row's start,
        slots and drafts the ones the device used."""
        got = self.flying.get(req.request_id)
        if got is None or got[0].chain is None or got[0].resolved:
            return
        s, c = got[0], got[0].chain
        s.start += accepted - c.base
        s.end = s.start + 1
        s.targets = targets(c.pool, c.cand[accepted], c.ndraft + 1)
        s.write_slot = s.targets[c.ndraft]
        s.drafts = tuple(int(d) for d in mtp_drafts[:c.ndraft])
        s.resolved = True

    def _chained_spec(self, s: ScheduledSeq) -> SeqSpec:
        c, lease = s.chain, s.req.lease
        tokens = np.zeros(1 + c.ndraft, np.int32)  # the bonus and the drafts: the device's
        return SeqSpec(tokens=tokens, prefix_len=s.start, page_ids=lease.page_ids,
                       read_slot=c.cand[c.base], write_slot=s.write_slot,
                       snapshots=[(j, s.targets[j - 1]) for j in range(1, c.ndraft + 1)],
                       logits="all")

    def verify_spec(self, s: ScheduledSeq) -> SeqSpec:
        """The row: ``[last token, d_1..d_m]``, logits everywhere, a state at every offset."""
        if s.chain is not None:
            return self._chained_spec(s)
        req, start, m = s.req, s.start, len(s.drafts)
        snaps = [(j, s.targets[j - 1]) for j in range(1, m + 1)]
        if not s.branch:  # [tree] a window snapshot is branch 0's (``speculative/tree.py``)
            window = req.lease.row_snapshots(start, start + m + 1)
            snaps += [(pos - start, slot) for pos, slot in window]
        tokens = np.concatenate([req.token_slice(start, start + 1),
                                 np.asarray(s.drafts, np.int32)])
        return SeqSpec(tokens=tokens, prefix_len=start, page_ids=row_pages(s, self.page_size),
                       read_slot=req.lease.state_slot, write_slot=s.write_slot, snapshots=snaps,
                       logits="all")

    # ---- after the step --------------------------------------------------------------------
    def accept(self, s: ScheduledSeq, tokens: np.ndarray, stops: Callable[[int], bool]) -> int:
        """Record the outcome of a verify row; returns ``e``, the tokens ``tokens[:e]`` to emit.

        ``tokens[j]``: the target's token after position ``j`` of the row. ``stops(j)``: token
        ``j`` ends the request (stop token, eos or length), so nothing after it is emitted.
        """
        req, start, m = s.req, s.start, len(s.drafts)
        accepted = accepted_drafts(s.drafts, tokens)
        emitted = next((j + 1 for j in range(accepted + 1) if stops(j)), accepted + 1)
        n = start + emitted
        req.lease.written(n, s.targets[emitted - 1], prefill_done=True)
        req.lease.settle_window(start, start + m + 1, n)
        nxt = self.flying.get(req.request_id)
        if emitted <= accepted and nxt is not None and nxt[0].chain is not None:
            c = nxt[0].chain  # [overlap] a stop inside the drafts: the chained row in flight
            if s.targets[emitted - 1] in targets(c.pool, c.cand[accepted], c.ndraft + 1):
                req.lease.state_overwritten()  # writes the state: no end snapshot of it
        self.last_accepted = accepted
        if m:  # [overlap] a chained row whose drafts did not hold is a decode, not a verify
            if self.adaptive:
                self._budget[req.request_id] = min(self.k, accepted + 1)
            self.verify_steps += 1
            self.verify_rows += 1
            self.verify_tokens += m + 1
            self.draft_tokens += m
            self.accepted_tokens += accepted
            self.emitted_tokens += emitted
        return emitted

    def choose_branch(self, s: ScheduledSeq, tokens: list[np.ndarray]) -> ScheduledSeq:
        """[tree] The tree of first row ``s`` is read (``tokens[b]``: branch ``b``'s row's
        tokens): the branch the target follows (``speculative.tree.pick_branch``), whose pages and
        drafter state become the request's; the others' pages are freed. ``accept`` the
        returned row next."""
        rows = (s, *s.branches)
        b = pick_branch([r.drafts for r in rows], tokens)
        s.req.lease.settle_branches(s.start, b)
        if b:  # [page > 1] branch 0's window snapshots hold its own path's states: freed
            s.req.lease.settle_window(s.start, s.start + len(s.drafts) + 1, s.start)
        self.drafter.chose(s.req.request_id, b)
        self.branch_wins += b > 0
        others = [r for r in rows if r is not rows[b]]
        self.verify_rows += len(others)
        self.verify_tokens += sum(len(r.drafts) + 1 for r in others)
        self.draft_tokens += sum(len(r.drafts) for r in others)
        return rows[b]

    # ---- observability ---------------------------------------------------------------------
    def metrics(self) -> dict[str, Any]:
        v = self.verify_steps
        return {"spec_verify_steps": v, "spec_draft_tokens": self.draft_tokens,
                "spec_accepted_tokens": self.accepted_tokens,
                "spec_accept_rate": self.accepted_tokens / self.draft_tokens
                if self.draft_tokens else 0.0,
                "spec_tokens_per_verify": self.emitted_tokens / v if v else 0.0,
                "spec_verify_rows": self.verify_rows, "spec_branch_wins": self.branch_wins,
                "spec_verify_width": self.verify_tokens / v if v else 0.0}

    def check_lanes(self, running: Sequence[Request], tree_slots: set[int]) -> None:
        """Raise if a lane is held twice or lost, or a scratch slot is the tree's."""
        held = [(r.lease.scratch_slots[0] - self.scratch_base) // self.width
                for r in running if r.lease.scratch_slots]
        if sorted(held + self._free_lanes) != list(range(self.num_lanes)):
            raise AssertionError(f"scratch lanes held {sorted(held)} + free "
                                 f"{sorted(self._free_lanes)} != {self.num_lanes} lanes")
        foreign = sorted(s for s in tree_slots if s >= self.scratch_base)
        if foreign:
            raise AssertionError(f"the tree holds scratch slots {foreign}")


def accepted_drafts(drafts: tuple[int, ...], tokens: np.ndarray) -> int:
    """How many drafts the target agrees with: ``d_j == t_{j-1}`` for ``j = 1..a``."""
    accepted = 0
    while accepted < len(drafts) and int(tokens[accepted]) == drafts[accepted]:
        accepted += 1
    return accepted


def spec_metrics(spec: SpecDecoder | None) -> dict[str, Any]:
    """The ``spec_*`` keys of ``Engine.metrics()`` (zeros when speculation is off)."""
    if spec is None:
        return {"spec_verify_steps": 0, "spec_draft_tokens": 0, "spec_accepted_tokens": 0,
                "spec_accept_rate": 0.0, "spec_tokens_per_verify": 0.0,
                "spec_verify_rows": 0, "spec_branch_wins": 0, "spec_verify_width": 0.0}
    return spec.metrics()
