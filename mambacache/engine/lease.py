"""``Lease``: one request's cache state, and the only code that changes it.

A lease holds what a request has of the cache while it runs: the matched node (locked), the
slot its first step reads (``read_slot``), its running slot, the slot holding its newest state
(``state_slot``, valid once a step ran: ``state_valid``), the tree's pages it reuses
(``cached_page_ids``) and the pages it allocated (``own_page_ids``), the snapshots planned for it
(``pending_snapshots``: position -> slot) and those a dispatched step writes
(``snapshots_in_flight``), its speculative scratch lane (``scratch_slots``) and draft tree
branches' pages (``branch_page_ids``: between a tree's planning and its read), how many tokens went
through the model (``num_computed``) and whether its prefill is done (``prefilled``).

Only this module and ``cache_manager.py`` write these fields (``tests/test_lease_ownership.py``
fails on a write anywhere else in ``mambacache/``). Every transition is a method; its docstring
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

if TYPE_CHECKING:
    from mambacache.engine.cache_manager import CacheManager

#: the empty page list a lease starts with (shared, read only: page arrays are reassigned,
#: never written in place)
NO_PAGES = np.zeros(0, np.int32)
NO_PAGES.flags.writeable = False

#: the lease's own fields: no module but ``lease.py`` and ``cache_manager.py`` writes them
LEASE_FIELDS = ("node", "read_slot", "running_slot", "state_slot", "state_valid", "prefilled",
                "num_computed", "cached_page_ids", "own_page_ids", "pending_snapshots",
                "snapshots_in_flight", "scratch_slots", "branch_page_ids")


class TokenSource(Protocol):
    """What a lease needs of its request to insert into the tree (``Request`` is one)."""

    request_id: int
    extra_key: str | None

    def token_slice(self, start: int, end: int) -> np.ndarray: ...


class Lease:
    """One request's cache state (module docstring). Created empty by ``CacheManager.lease``."""

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

    def _drop_page_buf(self) -> None:
        """Forget the growth buffer (``grow``): called wherever a page list is reassigned
        other than by ``grow``. ``_page_buf`` holds ``cached_page_ids`` then ``own_page_ids``
        then spare room; ``own_page_ids`` and ``_page_view`` (= ``page_ids``) are views of it.
        ``grow`` writes only past the views' end, so no array handed out ever changes."""
        self._page_buf: np.ndarray | None = None
        self._page_view: np.ndarray | None = None

    # ---- reads -----------------------------------------------------------------------------
    @property
    def held(self) -> bool:
        """The lease holds a running slot (its request was admitted and not released)."""
        return self.running_slot is not None

    @property
    def page_ids(self) -> np.ndarray:
        """``cached_page_ids + own_page_ids`` (int32; read only: it may be either part itself or
        the concatenation kept from the last call while neither part was reassigned)."""
        view = self._page_view
        if view is not None:  # grown in place (``grow``)
            return view
        cached, own = self.cached_page_ids, self.own_page_ids
        if not len(cached):
            return own
        if not len(own):
            return cached
        memo = self._page_ids_memo
        if memo is not None and memo[0] is cached and memo[1] is own:
            return memo[2]
        joined = np.concatenate([cached, own])
        self._page_ids_memo = (cached, own, joined)
        return joined

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

    def keeps_end_snapshot(self, keep: bool) -> bool:
        """Whether ``release(keep=keep)`` hands the running slot to the tree as the end state
        (the state is valid, page aligned and not already a written snapshot). No mutation."""
        n = self.num_computed
        return keep and self.state_valid and self._mgr.is_page_boundary(n) \
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
                     shared: Callable[[], set[int]]) -> None:
        """[cache on] Plan the prefill's snapshot positions (``plan_snapshots`` plus the
        positions ``shared()`` names: in-batch dedup) and give them slots (as many as the pool
        has). Mutates ``pending_snapshots`` and the slot allocator."""
        mgr = self._mgr
        if not mgr.enable:
            return
        ps = mgr.page_size
        positions = plan_snapshots(num_tokens, cached_len, branch_len, ps,
                                   mgr.checkpoint_interval)
        extra = shared()
        positions = sorted(set(positions) | extra) if extra else positions
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
    def grow(self, end: int) -> bool:
        """Make the pages cover ``end`` tokens; False if the pool cannot (nothing taken).
        Mutates ``own_page_ids`` and the page allocator (may evict unlocked tree pages)."""
        # pages_short(end), inline: called per row of every step
        need = -(-end // self._mgr.page_size) - len(self.cached_page_ids) - len(self.own_page_ids)
        if need <= 0:
            return True
        if need == 1:  # a decode row at page size 1, every step: no array
            cache = self._mgr.cache
            # the free list's top when no eviction can be needed (what ``alloc_page`` returns)
            page = cache.pages.alloc_one() if cache.budget is None else None
            if page is None:
                page = cache.alloc_page()
                if page is None:
                    return False
            self.take_page(page)
            return True
        pages = self._mgr.cache.alloc_pages(need)
        if pages is None:
            return False
        self.take_pages(pages)
        return True

    def pages_short(self, end: int) -> int:
        """Pages ``grow(end)`` would allocate (0 or less: none). No mutation."""
        return -(-end // self._mgr.page_size) - len(self.cached_page_ids) - len(self.own_page_ids)

    def take_pages(self, pages: np.ndarray) -> None:
        """Append ``pages``, allocated for this lease (by ``grow``, or by
        ``CacheManager.grow_rows`` for a whole step), to ``own_page_ids``. Mutates
        ``own_page_ids``.

        In place into a buffer with room: a decode row adds one page per step at page size 1,
        without a copy of the whole list per step."""
        num_cached = len(self.cached_page_ids)
        have = num_cached + len(self.own_page_ids)
        total = have + len(pages)
        buf = self._buffer(num_cached, have, total)
        buf[have:total] = pages
        self.own_page_ids = buf[num_cached:total]
        self._page_view = buf[:total]

    def take_page(self, page: int) -> None:
        """``take_pages`` of one page id (a Python int). Mutates ``own_page_ids``."""
        buf, view = self._page_buf, self._page_view
        if view is not None:  # the buffer in use (every decode step but the first)
            have = len(view)
            if have < len(buf):
                buf[have] = page
                self.own_page_ids = buf[len(self.cached_page_ids):have + 1]
                self._page_view = buf[:have + 1]
                return
        num_cached = len(self.cached_page_ids)
        have = num_cached + len(self.own_page_ids)
        buf = self._buffer(num_cached, have, have + 1)
        buf[have] = page
        self.own_page_ids = buf[num_cached:have + 1]
        self._page_view = buf[:have + 1]

    def _buffer(self, num_cached: int, have: int, total: int) -> np.ndarray:
        """The growth buffer with room for ``total`` pages, the ``have`` current ones in it."""
        buf = self._page_buf
        if buf is not None and len(buf) >= total:
            return buf
        old = buf
        buf = np.empty(max(2 * total, 64), np.int32)
        if old is not None:
            buf[:have] = old[:have]
        else:
            buf[:num_cached] = self.cached_page_ids
            buf[num_cached:have] = self.own_page_ids
        self._page_buf = buf
        return buf

    def room(self, start: int) -> int:
        """Tokens past ``start`` the pages already cover."""
        return len(self.page_ids) * self._mgr.page_size - start

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

    def plan_decode_snapshot(self, end: int) -> int | None:
        """[cache on, page > 1] A decode ending on a page boundary writes its state to a fresh
        slot (a snapshot without a copy): that slot, with the older pending ones given back (no
        row of this step reads them), or None (not a boundary, or the pool is short: counted as
        skipped). Mutates ``pending_snapshots``, ``snapshots_in_flight``, the slot allocator."""
        mgr = self._mgr
        if not mgr.boundary_snapshots or end % mgr.page_size:  # per decode row: no call
            return None
        slot = mgr.cache.alloc_slot()
        if slot is None:
            mgr.cache.record_skipped()
            return None
        stale = [s for pos, s in self.pending_snapshots.items() if pos < end]
        if stale:
            mgr.cache.free_slots(stale)
        self.pending_snapshots = {end: slot}
        self.snapshots_in_flight = set()
        return slot

    def plan_decode_window(self, start: int, end: int) -> tuple[int, int] | None:
        """[cache on, page > 1, multi-step decode] A row computing ``(start, end]`` in one
        dispatch: the state at its first page boundary ``b`` goes to a fresh slot; ``(b, slot)``,
        or None (no boundary, or the pool is short: counted as skipped). Older pending snapshots
        are given back, except the one this row reads (``state_slot``: the previous window
        ended on a boundary), which stays planned until the next window; ``b`` is marked in
        flight (written once the row's count reaches it). Mutates
        ``pending_snapshots``, ``snapshots_in_flight``, the slot allocator."""
        mgr = self._mgr
        if not mgr.boundary_snapshots:
            return None
        b = (start // mgr.page_size + 1) * mgr.page_size
        if b > end:
            return None
        got = mgr.cache.alloc_slots(1)
        if got is None:
            mgr.cache.record_skipped()
            return None
        read = self.state_slot if self.state_valid else None
        kept = {pos: sl for pos, sl in self.pending_snapshots.items() if sl == read}
        stale = [sl for pos, sl in self.pending_snapshots.items() if pos < b and sl != read]
        if stale:
            mgr.cache.free_slots(stale)
        slot = int(got[0])
        self.pending_snapshots = {**kept, b: slot}
        self.snapshots_in_flight = (self.snapshots_in_flight & kept.keys()) | {b}
        return b, slot

    def rewind(self, n: int, slot: int) -> None:
        """[multi-step decode] A row stopped inside its dispatch: ``n`` tokens went through the
        model and the state after them is in ``slot`` (later iterations and the rows chained
        after it were frozen on the device: they wrote nothing). If ``slot`` is no longer this
        lease's (a later window gave it back), no state is valid: no end snapshot at release.
        Mutates ``num_computed``, ``state_slot``, ``state_valid``."""
        held = slot == self.running_slot or slot in self.pending_snapshots.values()
        self.num_computed, self.state_slot, self.state_valid = n, slot, held

    def plan_window_snapshots(self, first: int, end: int) -> None:
        """[speculative, cache on, page > 1] Plan a snapshot at every page boundary in
        ``[first, end)`` (a verify window; a short pool skips and counts). Mutates
        ``pending_snapshots`` and the slot allocator."""
        mgr = self._mgr
        if not mgr.boundary_snapshots:
            return
        for pos in range(first, end):
            if mgr.is_page_boundary(pos) and not self.plan_snapshot(pos):
                mgr.cache.record_skipped()

    def take_lane(self, slots: tuple[int, ...]) -> None:
        """[speculative] Hold the scratch lane ``slots`` (none held yet). Mutates
        ``scratch_slots``."""
        if self.scratch_slots:
            raise AssertionError(f"lease holds lane {self.scratch_slots}, offered {slots}")
        self.scratch_slots = slots

    def drop_lane(self) -> tuple[int, ...]:
        """[speculative] Give the scratch lane back; the slots it held. Mutates
        ``scratch_slots``."""
        lane, self.scratch_slots = self.scratch_slots, ()
        return lane

    def take_branch_pages(self, n: int) -> np.ndarray | None:
        """[speculative tree, page size 1] ``n`` pages for one more draft branch (its tokens
        from the request's next position on), or None if fewer are free (drafts do not evict
        the cache for a branch). Mutates ``branch_page_ids`` and the page
        allocator."""
        if self._mgr.cache.pages.num_free < n:
            return None
        pages = self._mgr.cache.alloc_pages(n)
        if pages is None:
            return None
        pages = np.asarray(pages, np.int32)
        self.branch_page_ids = (*self.branch_page_ids, pages)
        return pages

    def settle_branches(self, start: int, winner: int) -> None:
        """[speculative tree, page size 1] The tree verified from position ``start`` is read:
        branch ``winner`` (0: the lease's own pages; ``b`` >= 1: ``branch_page_ids[b - 1]``)
        holds the accepted tokens' KV. A branch winner's pages take the place of the own pages
        at ``[start, start + len)``; every page of the other branches (and the replaced ones)
        is freed. Mutates ``own_page_ids``, ``branch_page_ids`` and the page allocator."""
        branches, self.branch_page_ids = self.branch_page_ids, ()
        drop = [p for b, p in enumerate(branches, 1) if b != winner]
        if winner:
            pages = branches[winner - 1]
            own = np.array(self.own_page_ids, np.int32)
            i = start - len(self.cached_page_ids)
            if i < 0 or i + len(pages) > len(own):
                raise AssertionError(f"branch pages for [{start}, {start + len(pages)}) outside "
                                     f"the own pages [{len(self.cached_page_ids)}, "
                                     f"{len(self.cached_page_ids) + len(own)})")
            drop.append(own[i:i + len(pages)].copy())
            own[i:i + len(pages)] = pages
            self.own_page_ids = own
            self._drop_page_buf()
        if drop:
            self._mgr.cache.free_pages(np.concatenate(drop))

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

    def state_overwritten(self) -> None:
        """[speculative, overlap] A row in flight writes ``state_slot`` (the request stopped
        inside a verify window while its next row ran): no end snapshot of it at release.
        Mutates ``state_valid``."""
        self.state_valid = False

    def settle_window(self, start: int, end: int, n: int) -> None:
        """[speculative] A verify window ``(start, end]`` accepted up to ``n`` tokens: free its
        snapshots past ``n`` (draft states); if one was accepted it is the newest page-aligned
        state and older pending ones go. Mutates ``pending_snapshots``, ``snapshots_in_flight``
        and the slot allocator."""
        pending = self.pending_snapshots
        window = [pos for pos in pending if start < pos <= end]
        kept = [pos for pos in window if pos <= n]
        drop = [pos for pos in window if pos > n]
        if kept:
            drop += [pos for pos in pending if pos < max(kept)]
        if drop:
            self._mgr.cache.free_slots(np.asarray([pending.pop(p) for p in drop], np.int32))
            self.snapshots_in_flight.difference_update(drop)

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
        end_snapshot = keep and self.state_valid and n % mgr.page_size == 0 and n not in snaps
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
