"""``Lease``: one request's cache state, and the only code that changes it.

A lease holds what a request has of the cache while it runs: the matched node (locked), the
slot its first step reads (``read_slot``), its running slot, the slot holding its newest state
(``state_slot``, valid once a step ran: ``state_valid``), the tree's pages it reuses
(``cached_page_ids``) and the pages it allocated (``own_page_ids``), the snapshots planned for it
(``pending_snapshots``: position -> slot) and those a dispatched step writes
(``snapshots_in_flight``), its speculative scratch lane (``scratch_slots``) and draft tree
branches' pages (``branch_page_ids``: between a tree's planning and its read), how many tokens went
through the model (``num_computed``) and whether its prefill is done (``prefilled``).

Only this module, its two mixins (``leases/pages.py``: the page list and its growth buffer;
``leases/windows.py``: decode and verify windows, the scratch lane, draft branches) and
``cache_manager.py`` write these fields (``tests/test_lease_ownership.py`` fails on a write
anywhere else in ``mambacache/``). Every transition is a method; its docstring
says what it mutates in the lease and in the cache, and what must be locked.

Invariants (``CacheManager.check``):
  * an empty lease (waiting, finished) holds nothing: no node, no slot, no page;
  * a held lease owns exactly one running slot and ``own_page_ids``; ``page_ids =
    cached_page_ids + own_page_ids`` cover ``num_computed`` tokens; its node stays locked, so
    ``cached_page_ids`` and ``read_slot`` (the node's state) cannot be evicted under it;
  * ``pending_snapshots`` slots belong to the cache from the moment they are planned: the tree
    adopts them on insert (or they are freed); none is the running or the state slot;
  * ``state_slot`` is the running slot, a page-boundary decode snapshot, or a scratch slot of
    the lane (outside the cache's ids).

Host only, no JAX.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from mambacache.cache.node import MatchResult, as_tokens
from mambacache.cache.snapshot_plan import assign_snapshot_slots, plan_snapshots
from mambacache.engine.leases.pages import NO_PAGES, LeasePages
from mambacache.engine.leases.windows import LeaseWindows

if TYPE_CHECKING:
    from mambacache.engine.leases.cache_manager import CacheManager

#: the lease's own fields: no module but the lease's (``lease.py``, ``leases/pages.py``,
#: ``leases/windows.py``) and ``cache_manager.py`` writes them
LEASE_FIELDS = ("node", "read_slot", "running_slot", "state_slot", "state_valid", "prefilled",
                "num_computed", "cached_page_ids", "own_page_ids", "pending_snapshots",
                "snapshots_in_flight", "scratch_slots", "branch_page_ids")


class TokenSource(Protocol):
    """What a lease needs of its request to insert into the tree (``Request`` is one)."""

    request_id: int
    prompt_len: int
    extra_key: str | None

    def token_slice(self, start: int, end: int) -> np.ndarray: ...


class Lease(LeasePages, LeaseWindows):
    """One request's cache state (module docstring). Created empty by ``CacheManager.lease``.
    Its page list (``leases/pages.py``) and its decode / verify windows, scratch lane and draft
    branches (``leases/windows.py``) are transitions of mixins in their own files."""

    __slots__ = ("_mgr", "_page_ids_memo", "_page_buf", "_page_view", *LEASE_FIELDS)

    def __init__(self, manager: CacheManager):
        self._mgr = manager
        self._clear()

    def _clear(self) -> None:
        self.node: Any = None  # mambacache.cache.node.Node (or the disabled cache's root)
        self.read_slot: int | None = None  # the cached state (None: zero state); first step only
        self.running_slot: int | None = None
        self.state_slot: int | None = None  # running slot, boundary snapshot or scratch slot
        self.state_valid = False  # state_slot holds the state after num_computed tokens
        self.prefilled = False  # the chunk reaching the last token ran: decode from here on
        self.num_computed = 0  # tokens fed through the model (cached ones included)
        self.cached_page_ids: np.ndarray = NO_PAGES
        self.own_page_ids: np.ndarray = NO_PAGES  # int32, pages this request allocated
        self.pending_snapshots: dict[int, int] = {}
        self.snapshots_in_flight: set[int] = set()  # positions a dispatched step writes
        self.scratch_slots: tuple[int, ...] = ()  # speculative lane, outside the cache's slots
        # [speculative tree] pages of branches 1.. of the tree in flight (page size 1)
        self.branch_page_ids: tuple[np.ndarray, ...] = ()
        # (cached, own, their concatenation) of the last ``page_ids``: page arrays are never
        # written in place, only reassigned, so identity says it is current
        self._page_ids_memo: tuple | None = None
        self._drop_page_buf()

    # ---- reads -----------------------------------------------------------------------------
    @property
    def held(self) -> bool:
        """The lease holds a running slot (its request was admitted and not released)."""
        return self.running_slot is not None

    @property
    def next_read_slot(self) -> int:
        """The slot the next step reads: the newest state, the cached one, or 0 (zero state)."""
        return self.state_slot if self.state_valid else (self.read_slot or 0)

    def own_slots(self) -> set[int]:
        """Slots this lease may write: running, planned snapshots, scratch lane."""
        return {self.running_slot, *self.pending_snapshots.values(), *self.scratch_slots} - {None}

    def writable_pages(self) -> set[int]:
        """Pages this lease may write: its own and its draft branches'."""
        out = set(self.own_page_ids.tolist())
        for pages in self.branch_page_ids:
            out.update(pages.tolist())
        return out

    def plans(self, pos: int) -> bool:
        """A snapshot is planned at ``pos``."""
        return pos in self.pending_snapshots

    def _written(self) -> dict[int, int]:
        """Planned snapshots a dispatched step has written (position -> slot)."""
        if not self.pending_snapshots:
            return {}
        n, flying = self.num_computed, self.snapshots_in_flight
        return {p: s for p, s in self.pending_snapshots.items() if p in flying and p <= n}

    def keeps_end_snapshot(self, keep: bool, prompt_len: int) -> bool:
        """Whether ``release(keep=keep)`` hands the running slot to the tree as the end state
        (the state is valid, at a position the tree keeps (``keeps_state_at``) and not already
        a written snapshot). No mutation."""
        n = self.num_computed
        return keep and self.state_valid and self._mgr.keeps_state_at(n, prompt_len) \
            and n not in self._written()

    # ---- admission ---------------------------------------------------------------------------
    def admit(self, m: MatchResult, num_tokens: int) -> bool:
        """Start from match ``m`` for ``num_tokens`` tokens: lock ``m.node`` (first, so what it
        pins no longer counts as evictable), check the uncached tokens' pages are available
        and take a running slot. False (nothing held, the lock undone) if the pools are short.
        Mutates the whole lease (from empty) and the cache's locks and slot allocator."""
        cache, mgr = self._mgr.cache, self._mgr
        need_pages = mgr.pages_for(num_tokens) - len(m.page_ids)
        if self.running_slot is not None:
            raise AssertionError(f"lease admitted twice (running slot {self.running_slot})")
        cache.lock(m.node)
        slot = cache.alloc_slot() if cache.available_pages() >= need_pages else None
        if slot is None:
            cache.unlock(m.node)
            return False
        # an admitted lease is empty (new, or cleared by ``release`` / ``abandon``)
        self.node, self.read_slot, self.running_slot = m.node, m.read_slot, slot
        self.cached_page_ids = as_tokens(m.page_ids)  # int32 already: no copy
        self._drop_page_buf()
        self.num_computed = m.cached_len
        return True

    def plan_prefill(self, num_tokens: int, cached_len: int, branch_len: int,
                     shared: Callable[[], set[int]], prompt_len: int | None = None) -> None:
        """[cache on] Plan the prefill's snapshot positions (``plan_snapshots`` plus the
        positions ``shared()`` names: in-batch dedup) and give them slots (as many as the pool
        has). [deterministic, Pallas] With a grid, positions the tree keeps states at only
        (``CacheManager.keeps_state_at`` of ``prompt_len``, default ``num_tokens``). Mutates
        ``pending_snapshots`` and the slot allocator."""
        mgr = self._mgr
        if not mgr.enable:
            return
        ps = mgr.state_unit  # the page size without a grid
        positions = plan_snapshots(num_tokens, cached_len, branch_len, ps,
                                   mgr.checkpoint_interval)
        extra = shared()
        positions = sorted(set(positions) | extra) if extra else positions
        if mgr.grid:
            end = num_tokens if prompt_len is None else prompt_len
            positions = [p for p in positions if mgr.keeps_state_at(p, end)]
        self.pending_snapshots = assign_snapshot_slots(mgr.cache, positions, branch_len,
                                                       num_tokens, ps)

    def plan_snapshot(self, pos: int) -> bool:
        """Plan a snapshot at ``pos`` (a slot from the pool; False if it has none). Mutates
        ``pending_snapshots`` and the slot allocator."""
        got = self._mgr.cache.alloc_slot()
        if got is None:
            return False
        self.pending_snapshots[pos] = got
        return True

    # ---- growth and rows ---------------------------------------------------------------------
    def row_snapshots(self, start: int, end: int) -> list[tuple[int, int]]:
        """The planned snapshots a row over ``(start, end]`` writes, sorted (position, slot);
        marks them in flight. Mutates ``snapshots_in_flight``."""
        if not self.pending_snapshots:
            return []
        planned = [(pos, slot) for pos, slot in self.pending_snapshots.items()
                   if start < pos <= end]
        if planned:
            planned.sort()
            self.snapshots_in_flight.update(pos for pos, _ in planned)
        return planned

    # ---- after a step ------------------------------------------------------------------------
    def written(self, end: int, state_slot: int, *, prefill_done: bool) -> bool:
        """A dispatched step left the state after ``end`` tokens in ``state_slot``; with
        ``prefill_done`` its row reached the last token. True if the prefill's planned
        snapshots should be published (before the next admission). Mutates ``num_computed``,
        ``state_valid``, ``state_slot``, ``prefilled``."""
        self.num_computed, self.state_valid, self.state_slot = end, True, state_slot
        if self.prefilled:
            return False
        self.prefilled = prefill_done
        return bool(self.pending_snapshots)

    def _take_written(self, *, drop_rest: bool) -> dict[int, int]:
        """Written snapshots, removed from ``pending_snapshots``; ``drop_rest`` frees the others."""
        if not self.pending_snapshots:
            return {}
        done = self._written()
        rest = {p: s for p, s in self.pending_snapshots.items() if p not in done}
        if drop_rest and rest:
            self._mgr.cache.free_slots(list(rest.values()))  # a list: no numpy for a few ids
            rest = {}
        self.pending_snapshots = rest
        self.snapshots_in_flight -= done.keys()
        return done

    def publish(self, src: TokenSource, *, final: bool) -> None:
        """Insert the prefix up to the deepest written snapshot, mid-flight (``final``: the
        prefill is done, so unwritten planned snapshots are freed).

        The tree keeps KV only up to its deepest state, so exactly that prefix is inserted; the
        lease switches to the tree's pages for it (its own duplicates were freed) and moves its
        lock to the new node. The slots offered are snapshot slots only, never one the request
        reads, so a slot the tree rejects (and frees) is referenced by no one. Mutates
        ``pending_snapshots``, ``snapshots_in_flight``, ``node``, both page lists, the tree.
        """
        snaps = self._take_written(drop_rest=final)
        if not snaps:
            return
        if self.state_slot in snaps.values() or self.running_slot in snaps.values():
            raise AssertionError(f"request {src.request_id} offers its running state to the tree")
        n = max(snaps)
        cache, ps = self._mgr.cache, self._mgr.page_size
        num_pages = n // ps
        pages = self.page_ids
        res = self._insert(cache, src, n, pages, num_pages, snaps)
        if res.kept_len // ps != num_pages:
            raise AssertionError(f"insert kept {res.kept_len} of {n} tokens of a running request")
        cache.lock(res.node)
        cache.unlock(self.node)
        self.node = res.node
        # no page freed: the tree's pages of the prefix are the ones passed (ids are unique, so
        # a page of the tree's own below the node would have freed ours as a duplicate)
        self.cached_page_ids = pages[:num_pages] if not res.freed_pages \
            else np.asarray(res.page_ids, np.int32)
        self.own_page_ids = pages[num_pages:]
        self._drop_page_buf()

    def release(self, src: TokenSource, *, keep: bool) -> None:
        """Give back everything; ``keep``: insert the computed tokens and written states first
        (the running slot as the end state when ``keeps_end_snapshot``). The scratch lane must
        be dropped already (``drop_lane``). Unlocks the node; the lease is empty afterwards."""
        if self.scratch_slots:
            raise AssertionError(f"request {src.request_id} released with its lane held")
        if self.branch_page_ids:  # a tree planned, not read (preempted while scheduling)
            self.settle_branches(0, 0)
        snaps = self._take_written(drop_rest=True)
        mgr, n = self._mgr, self.num_computed
        cache = mgr.cache
        end_snapshot = keep and self.state_valid and mgr.keeps_state_at(n, src.prompt_len) \
            and n not in snaps
        if mgr.grid and keep:  # [deterministic, Pallas] prompt tokens and grid states only
            n = mgr.insert_len(n, src.prompt_len)
            dropped = [s for p, s in snaps.items() if not mgr.keeps_state_at(p, src.prompt_len)]
            if dropped:
                cache.free_slots(dropped)
                snaps = {p: s for p, s in snaps.items() if mgr.keeps_state_at(p, src.prompt_len)}
        slot = self.running_slot
        if end_snapshot:
            snaps[n] = slot
        elif slot is not None:
            cache.free_slots([slot])
        pages = self.page_ids
        num_cached = len(self.cached_page_ids)
        used = max(mgr.pages_for(n), num_cached) if keep else num_cached
        if len(pages) > used:  # pages taken for tokens that were never computed
            cache.free_pages(pages[used:])
        if keep:
            self._insert(cache, src, n, pages, used, snaps)
        elif snaps:
            cache.free_slots(list(snaps.values()))
        cache.unlock(self.node)
        self._clear()

    def _insert(self, cache: Any, src: TokenSource, n: int, pages: np.ndarray, num_pages: int,
                snaps: dict[int, int]) -> Any:
        """``cache.insert`` of the first ``n`` tokens (KV ``pages[:num_pages]``, the lease's),
        as an extension below the locked node when it can be one: the node's path is the
        request's first ``node.depth`` tokens and ``cached_page_ids`` are the tree's pages of
        it, so only the part past it is walked and handed over (``TreeInsert.insert``'s
        ``below``); from the root when the node is a root or a snapshot lies at or above it.
        Mutates the tree and the allocators (``insert`` takes ownership of the pages passed
        and the snapshots' slots)."""
        node = self.node
        base = node.depth
        num_cached = len(self.cached_page_ids)
        if node.parent is None or base > n or num_cached * self._mgr.page_size != base \
                or (snaps and min(snaps) <= base):
            return cache.insert(src.token_slice(0, n), pages[:num_pages], snapshots=snaps,
                                extra_key=src.extra_key)
        return cache.insert(src.token_slice(base, n), pages[num_cached:num_pages],
                            snapshots=snaps, extra_key=src.extra_key, below=node)

    def abandon(self) -> None:
        """The pools and the cache are gone (a failed step consumed them): forget every id
        without giving any back. Mutates the whole lease (to empty)."""
        self._clear()
