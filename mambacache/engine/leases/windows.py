"""``LeaseWindows``: a lease's transitions around windows of tokens (a mixin of ``Lease``,
``lease.py``): page-boundary decode snapshots (one step, or the first boundary of a multi-step
decode window, and the rewind of a row stopped inside it), speculative verify windows (their
snapshots planned and settled by the accepted count), the speculative scratch lane and the
pages of draft tree branches.

Host only, no JAX.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from mambacache.engine.leases.cache_manager import CacheManager


class LeaseWindows:
    """Window transitions of ``Lease`` (module docstring); its fields live in
    ``Lease.__slots__``."""

    __slots__ = ()
    _mgr: CacheManager
    pending_snapshots: dict[int, int]
    snapshots_in_flight: set[int]
    scratch_slots: tuple[int, ...]
    branch_page_ids: tuple[np.ndarray, ...]

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
        slot = mgr.cache.alloc_slot()
        if slot is None:
            mgr.cache.record_skipped()
            return None
        read = self.state_slot if self.state_valid else None
        kept = {pos: sl for pos, sl in self.pending_snapshots.items() if sl == read}
        stale = [sl for pos, sl in self.pending_snapshots.items() if pos < b and sl != read]
        if stale:
            mgr.cache.free_slots(stale)
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
        """[speculative tree] ``n`` pages for one more draft branch (the pages its tokens fall
        in, from the page of the request's next position on), or None if fewer are free
        (drafts do not evict the cache for a branch). Mutates ``branch_page_ids`` and the page
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
        """[speculative tree] The tree verified from position ``start`` is read: branch
        ``winner`` (0: the lease's own pages; ``b`` >= 1: ``branch_page_ids[b - 1]``, from the
        page of ``start`` on, its first page holding a copy of the tokens before ``start``)
        holds the accepted tokens' KV. A branch winner's pages take the place of the own pages
        from the page of ``start`` on; every page of the other branches (and the replaced ones)
        is freed. Mutates ``own_page_ids``, ``branch_page_ids`` and the page allocator."""
        branches, self.branch_page_ids = self.branch_page_ids, ()
        drop = [p for b, p in enumerate(branches, 1) if b != winner]
        if winner:
            pages = branches[winner - 1]
            own = np.array(self.own_page_ids, np.int32)
            i = start // self._mgr.page_size - len(self.cached_page_ids)
            if i < 0 or i + len(pages) > len(own):
                first = start // self._mgr.page_size
                raise AssertionError(f"branch pages [{first}, {first + len(pages)}) outside "
                                     f"the own pages [{len(self.cached_page_ids)}, "
                                     f"{len(self.cached_page_ids) + len(own)})")
            drop.append(own[i:i + len(pages)].copy())
            own[i:i + len(pages)] = pages
            self.own_page_ids = own
            self._drop_page_buf()
        if drop:
            self._mgr.cache.free_pages(np.concatenate(drop))

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
