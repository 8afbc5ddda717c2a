"""``LeasePages``: a lease's page list (a mixin of ``Lease``, ``lease.py``): the pages it reuses
from the tree (``cached_page_ids``) and those it allocated (``own_page_ids``), read together as
``page_ids``, and their growth as a request computes more tokens (``grow``: one page per decode
step at page size 1 goes into a buffer with room, no copy of the list per step;
``CacheManager.grow_rows`` hands a whole step's pages out through ``take_page`` /
``take_pages``). Page arrays handed out are never written in place, only reassigned.

Host only, no JAX.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from mambacache.engine.leases.cache_manager import CacheManager

#: the empty page list a lease starts with (shared, read only: page arrays are reassigned,
#: never written in place)
NO_PAGES = np.zeros(0, np.int32)
NO_PAGES.flags.writeable = False


class LeasePages:
    """The page list of ``Lease`` (module docstring); its fields live in ``Lease.__slots__``."""

    __slots__ = ()
    _mgr: CacheManager
    cached_page_ids: np.ndarray
    own_page_ids: np.ndarray
    _page_buf: np.ndarray | None
    _page_view: np.ndarray | None
    _page_ids_memo: tuple | None

    def _drop_page_buf(self) -> None:
        """Forget the growth buffer (``grow``): called wherever a page list is reassigned
        other than by ``grow``. ``_page_buf`` holds ``cached_page_ids`` then ``own_page_ids``
        then spare room; ``own_page_ids`` and ``_page_view`` (= ``page_ids``) are views of it.
        ``grow`` writes only past the views' end, so no array handed out ever changes."""
        self._page_buf: np.ndarray | None = None
        self._page_view: np.ndarray | None = None

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
