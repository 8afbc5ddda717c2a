"""``CacheManager``: the engine's one owner of the prefix cache and of every request's lease.

It holds the cache (radix tree or the disabled cache, ``make_cache_from_config``) and the facts
of its layout: the page size, whether caching is on, the checkpoint interval. No other engine
module reads ``cache.page_size`` or ``cache.enable`` or does page arithmetic: they ask the
manager (``pages_for``: the one ceiling division; ``is_page_boundary``,
``next_page_boundary``) or the request's ``Lease`` (``lease.py``), whose transitions are the only
writers of cache state.

[deterministic, Pallas] ``grid`` (``pallas_kernels.ops.DETERMINISTIC_GRID``; 0 = off): the
chunked kernels compute a token from its chunk's start state, so a request's bits are a
function of its tokens only if every prompt is computed in the same chunks, on a grid of
absolute positions, and every token past a prompt one at a time (as a decode does). With a
grid: a prefill is cut only at grid multiples below its prompt's end and one token at a time
past it (``prefill_end``); the tree keeps states only at grid multiples within a prompt
(``state_floor``, ``keeps_state_at``; no page-boundary decode snapshots) and KV only of prompt
tokens (``insert_len``), so a hit resumes exactly where a prefill from scratch starts a chunk.

``check`` is the engine-wide ownership check: the cache's own integrity, then every id the
allocators list as held by a request is held by exactly one running request's lease, each held
lease covers its computed tokens, and no waiting request holds anything.

Host only, no JAX.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from mambacache.cache.base import CacheBase
from mambacache.cache.from_config import make_cache_from_config
from mambacache.cache.node import MatchResult
from mambacache.config import CacheConfig
from mambacache.engine.leases.lease import Lease
from mambacache.engine.request import Request, Status
from mambacache.engine.step.checks import check_step
from mambacache.engine.step.plan import ScheduledSeq, SeqSpec


class CacheManager:
    """The cache, its layout and the leases' factory (module docstring)."""

    def __init__(self, cfg: CacheConfig, transfer: Callable[..., None] | None = None,
                 loads: Any = None, grid: int = 0):
        self._cfg = cfg
        # [host tier] the runner's copy between the tiers: ``transfer(t: Transfer, in_use=)``;
        # ``loads``: the runner's ``load_ready(slot)`` / ``finish_load(slot)`` (promotions land
        # later), or None (a promotion is complete once issued)
        self._transfer = transfer
        self._loads = loads
        # [rebalance] the device pools' rows: ids above them are never handed out, and a match
        # that reaches one (a shrink waiting for it) counts as a miss (``set_limits``)
        self.limits: tuple[int, int] | None = \
            (cfg.num_pages, cfg.num_mamba_slots) if cfg.device_splits else None
        self.draining = False
        self.split_tuner = None  # [rebalance] fed by every cache this manager makes
        self.cache: CacheBase = self._make_cache()  # speculative states too
        self.page_size = cfg.page_size
        # tokens the whole KV pool holds (one request can never use more; with moving splits,
        # the smallest split's)
        pages = min(p for p, _ in cfg.device_splits) if cfg.device_splits \
            else self.cache.pages.num_ids
        self.kv_capacity_tokens = pages * cfg.page_size
        self.enable = cfg.enable
        self.checkpoint_interval = cfg.checkpoint_interval
        # [deterministic, Pallas] the prefill grid (module docstring; 0 = off) and the unit of
        # kept state positions: page boundaries, on the grid when there is one
        self.grid = grid
        self.state_unit = math.lcm(cfg.page_size, grid) if grid else cfg.page_size
        # a decode ending on a page boundary keeps its state as a snapshot (never on a grid)
        self.boundary_snapshots = cfg.enable and cfg.page_size > 1 and not grid

    def lease(self) -> Lease:
        """A new, empty lease for a request."""
        return Lease(self)

    def reset(self) -> None:
        """The pools are gone (a failed step consumed them): the cache starts empty (loads in
        flight with it). Leases of the failed requests must be ``abandon``-ed by the caller."""
        self.cache = self._make_cache()

    def _make_cache(self) -> CacheBase:
        cache = make_cache_from_config(self._cfg)
        if self.limits is not None:
            cache.pages.set_limit(self.limits[0])
            cache.slots.set_limit(self.limits[1])
        cache.split_tuner = self.split_tuner
        tier = cache.host_tier
        if tier is not None and self._transfer is not None:
            tier.on_transfer = functools.partial(self._transfer, in_use=tier.in_use)
            tier.async_loads = self._loads is not None
        return cache

    def promote(self, tokens: np.ndarray, extra_key: str | None) -> int:
        """[host tier] Bring the host-resident prefix of ``tokens`` that is deeper than the
        device's back to the device (the runner's copy is issued now, ordered before any step
        that reads it); returns the tokens gained (0 without a tier or without room)."""
        tier = self.cache.host_tier
        return tier.promote(tokens, extra_key) if tier is not None else 0

    def load_in_flight(self, slot: int | None) -> bool:
        """[host tier] Whether state ``slot`` waits for a promotion's load (no step may read it
        until ``land_loads`` finished it)."""
        tier = self.cache.host_tier
        return tier is not None and slot in tier.loading

    def loads_in_flight(self) -> int:
        tier = self.cache.host_tier
        return len(tier.loading) if tier is not None else 0

    def land_loads(self, upto: int | None = None, *, ready_only: bool = False) -> bool:
        """[host tier] Finish loads in the order they were issued (a later load may extend an
        earlier one's pages): all of them, or those up to the one into slot ``upto``, stopping
        (``ready_only``) at the first whose copy has not landed. Finishing dispatches its
        scatter and unlocks its node; the host never waits. True when every load asked for
        is finished."""
        tier = self.cache.host_tier
        if tier is None:
            return True
        for slot in list(tier.loading):
            if ready_only and not self._loads.load_ready(slot):
                return False
            self._loads.finish_load(slot)
            tier.landed(slot)
            if slot == upto:
                break
        return True

    def land_loads_read_by(self, specs: Iterable[SeqSpec]) -> None:
        """[host tier] Finish, in issue order, the loads in flight up to the last one that
        fills a KV page some row of ``specs`` reads (a page below its ``prefix_len``): a
        request's publish can trade its own pages for a loading node's (the tree deduplicates
        a prefix it already holds), and its next chunk reads them. Finishing dispatches the
        scatter; the host does not wait."""
        tier = self.cache.host_tier
        if tier is None or not tier.loading:
            return
        read = {int(p) for spec in specs for p in self._read_pages(spec)}
        last = None
        for slot, pages in tier.loading_pages.items():
            if not read.isdisjoint(pages.tolist()):
                last = slot
        if last is not None:
            self.land_loads(upto=last)

    def _read_pages(self, spec: SeqSpec) -> Sequence[int]:
        """The KV pages a row reads: those of its first ``prefix_len`` tokens."""
        return spec.page_ids[:self.pages_for(spec.prefix_len)]

    def count_load_wait(self) -> None:
        """[host tier] A request sat out a step because its load had not landed."""
        self.cache.host_tier.counters["load_wait_steps"] += 1

    def count_host_hit(self, tokens: int) -> None:
        """[host tier] An admitted request matched ``tokens`` that ``promote`` brought back."""
        self.cache.host_tier.count_hit(tokens)

    def grow_rows(self, rows: Sequence[tuple[Request, int]]) -> bool:
        """Grow each request's lease to its end (``Lease.grow``) with one page allocation for
        the whole step, each lease getting the page ids its own ``grow`` in this order would
        have got. Only when that is certain: the free pages suffice (no eviction), no byte
        budget, no boundary snapshots (whose slot allocations could evict pages between the
        grows). False (nothing taken): grow them one by one. Mutates the leases' pages and the
        page allocator."""
        ps, needs, total = self.page_size, [], 0
        for req, end in rows:  # Lease.pages_short, inline: per row of every step
            lease = req.lease
            k = -(-end // ps) - len(lease.cached_page_ids) - len(lease.own_page_ids)
            needs.append(k)
            if k > 0:
                total += k
        if not total:
            return True
        cache = self.cache
        if self.boundary_snapshots or cache.budget is not None or total > cache.pages.num_free:
            return False
        ids = cache.alloc_pages(total)  # one grow after another: the top of the free stack,
        hi = total  # the first grow's pages uppermost
        one = ids.tolist()  # a row short of one page (page size 1) takes a Python int
        for (req, _), k in zip(rows, needs, strict=True):
            if k == 1:
                req.lease.take_page(one[hi - 1])
                hi -= 1
            elif k > 0:
                req.lease.take_pages(ids[hi - k:hi])
                hi -= k
        return True

    # ---- page arithmetic ---------------------------------------------------------------------
    def pages_for(self, num_tokens: int) -> int:
        """Pages that hold ``num_tokens`` tokens (the one ceiling division of the engine)."""
        return -(-num_tokens // self.page_size)

    def next_page_boundary(self, n: int) -> int:
        """The first page boundary after ``n``."""
        return (n // self.page_size + 1) * self.page_size

    def is_page_boundary(self, n: int) -> bool:
        return n % self.page_size == 0

    def state_floor(self, n: int) -> int:
        """``n`` rounded down to a position the tree may keep a state at (a page boundary; on
        the grid when there is one)."""
        return n // self.state_unit * self.state_unit

    # ---- [deterministic, Pallas] the prefill grid (module docstring) -------------------------
    def keeps_state_at(self, pos: int, prompt_len: int) -> bool:
        """May the tree keep the state after ``pos`` tokens of a request with a prompt of
        ``prompt_len`` tokens? Page boundaries; with a grid, grid multiples within the prompt."""
        return pos % self.state_unit == 0 and (not self.grid or pos <= prompt_len)

    def insert_len(self, num_computed: int, prompt_len: int) -> int:
        """Tokens of a request the tree may take: all computed ones; with a grid, prompt
        tokens only (a token past the prompt was computed alone, a prefill from scratch
        computes it in a chunk)."""
        return min(num_computed, prompt_len) if self.grid else num_computed

    def prefill_end(self, start: int, end: int, prompt_len: int) -> int:
        """The end of a prefill chunk from ``start`` that the budget lets reach ``end``: as
        is without a grid; with one, the prompt's end or the last grid multiple before
        ``end`` (``start`` when none: no chunk this step), and one token past the prompt."""
        if not self.grid or end <= start:
            return end
        if start >= prompt_len:
            return start + 1
        if end >= prompt_len:
            return prompt_len
        return max(start, end // self.grid * self.grid)

    # ---- admission back-pressure -------------------------------------------------------------
    def holds_back(self, running: Sequence[Request], m: MatchResult, num_tokens: int) -> bool:
        """[byte budget] The budget's ``running_share`` holds back a request of ``num_tokens``
        tokens matched at ``m``: requests run, and their own bytes plus its own would pass that
        share (``ByteBudget.admits``). A request's own bytes: its running slot and the pages of
        its known tokens past the prefix it hit (``cached_tokens``), allocated or still to come
        (the prefill's published pages stay locked under it). No mutation."""
        b = self.cache.budget
        if b is None or b.running_share >= 1 or not running:
            return False
        ps = self.page_size
        held = sum(b.request_bytes(-(-r.num_tokens // ps) - r.cached_tokens // ps)
                   for r in running)
        return not b.admits(held, b.request_bytes(self.pages_for(num_tokens) - len(m.page_ids)))

    # ---- [rebalance] id limits -----------------------------------------------------------------
    def set_limits(self, num_pages: int, num_slots: int) -> None:
        """Hand out page ids ``1..num_pages`` and slot ids ``1..num_slots`` only (the device
        pools' rows; ``IdAllocator.set_limit``). A limit below ids in use makes a drain: their
        unlocked tree entries go with ``evict_above``, and until none is in use a match that
        reaches one is a miss (no new lock holds them)."""
        self.limits = (num_pages, num_slots)
        self.cache.pages.set_limit(num_pages)
        self.cache.slots.set_limit(num_slots)
        self.draining = self.in_use_above_limits() > 0

    def use_split_tuner(self, tuner) -> None:
        """Feed ``tuner`` (``cache/rebalance.SplitTuner``) every match and insert."""
        self.split_tuner = self.cache.split_tuner = tuner

    def in_use_above_limits(self) -> int:
        """Page and slot ids above the limits still held by a request or the tree."""
        c = self.cache
        return c.pages.in_use_above_limit() + c.slots.in_use_above_limit()

    def evict_above_limits(self) -> int:
        """Drop the unlocked tree entries above the limits; the ids still in use above them."""
        if self.limits is not None:
            self.cache.evict_above(*self.limits)
        self.draining = self.in_use_above_limits() > 0
        return self.in_use_above_limits()

    # ---- lookups -----------------------------------------------------------------------------
    def match(self, tokens: np.ndarray, extra_key: str | None) -> MatchResult:
        """The longest cached prefix of ``tokens`` with a state (no mutation but recency);
        [rebalance] while a shrink drains, a match holding an id above the limits is a miss."""
        m = self.cache.match_prefix(tokens, extra_key=extra_key)
        if self.draining and m.cached_len and (
                int(m.page_ids.max()) > self.limits[0] or (m.read_slot or 0) > self.limits[1]):
            return self.empty_match(m)
        return m

    @staticmethod
    def empty_match(m: MatchResult) -> MatchResult:
        """``m`` without its hit: nothing cached, the root of ``m.node``'s tree as the node."""
        root = m.node
        while root.parent is not None:
            root = root.parent
        return MatchResult(0, m.page_ids[:0], None, root, 0)

    def tree_slots(self) -> set[int]:
        """Every state slot a tree node holds (none for the disabled cache)."""
        out, todo = set(), list(getattr(self.cache, "roots", {}).values())
        while todo:
            node = todo.pop()
            if node.slot is not None:
                out.add(node.slot)
            todo.extend(node.children.values())
        return out

    # ---- checks ------------------------------------------------------------------------------
    def check_step(self, scheduled: Sequence[ScheduledSeq]) -> None:
        """Raise if a scheduled step breaks a step invariant (``step.checks.check_step``)."""
        check_step(self.cache, scheduled, self.page_size)
        if self.loads_in_flight():  # [host tier] a state or page still loading is read by no row
            loading = {p for pages in self.cache.host_tier.loading_pages.values()
                       for p in pages.tolist()}
            for s in scheduled:
                if self.load_in_flight(s.spec.read_slot):
                    raise AssertionError(f"request {s.req.request_id} reads state slot "
                                         f"{s.spec.read_slot} before its load has landed")
                read = self._read_pages(s.spec)
                if not loading.isdisjoint(int(p) for p in read):
                    raise AssertionError(f"request {s.req.request_id} reads KV pages "
                                         f"{sorted(loading.intersection(map(int, read)))} "
                                         "before their load has landed")

    def check(self, running: Iterable[Request], waiting: Iterable[Request]) -> None:
        """Raise ``AssertionError`` unless the cache is intact and the allocators' held ids are
        exactly those of the running requests' leases (module docstring)."""
        self.cache.check_integrity()
        held_slots: list[int] = []
        held_pages: list[int] = []
        busy = False
        for req in running:
            busy = True
            lease = req.lease
            if req.status is not Status.RUNNING or not lease.held:
                raise AssertionError(f"request {req.request_id} in the running list is "
                                     f"{req.status}")
            held_slots.append(lease.running_slot)
            held_slots.extend(lease.pending_snapshots.values())
            held_pages.extend(lease.own_page_ids.tolist())
            for pages in lease.branch_page_ids:  # [speculative tree] between plan and read
                held_pages.extend(pages.tolist())
            if len(lease.page_ids) * self.page_size < lease.num_computed:
                raise AssertionError(f"request {req.request_id}: {len(lease.page_ids)} pages "
                                     f"cannot hold {lease.num_computed} computed tokens")
        for req in waiting:
            busy = True
            if req.status is not Status.WAITING or req.lease.held or len(req.lease.own_page_ids):
                raise AssertionError(f"waiting request {req.request_id} holds resources")
        cache = self.cache
        for name, held, alloc in (("slot", held_slots, cache.slots),
                                  ("page", held_pages, cache.pages)):
            mine = np.sort(np.asarray(held, np.int64))
            listed = np.sort(np.asarray(alloc.held_ids(), np.int64))
            if mine.size != np.unique(mine).size:
                raise AssertionError(f"a state {name} is held by two requests: {mine.tolist()}")
            if not np.array_equal(mine, listed):
                leaked = np.setdiff1d(listed, mine).tolist()
                missing = np.setdiff1d(mine, listed).tolist()
                raise AssertionError(f"{name}s held per allocator but by no request: {leaked}; "
                                     f"held by requests but not per allocator: {missing}")

        loads = self.loads_in_flight()
        if not busy and (loads or self.cache.locked_slots() or self.cache.locked_pages()):
            raise AssertionError(f"idle: {loads} loads in flight, {self.cache.locked_slots()} "
                                 f"states and {self.cache.locked_pages()} pages locked")

    def describe(self) -> str:
        """The pools' occupancy, for the no-progress error."""
        c = self.cache
        return (f"pages available {c.available_pages()} of {c.pages.num_ids} "
                f"(locked {c.locked_pages()}); slots available {c.available_slots()} of "
                f"{c.slots.num_ids} (locked {c.locked_slots()})")
