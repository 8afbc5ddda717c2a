"""The shadow runner's pools as a whole (``ShadowPools``, a mixin of ``ShadowRunner``): lost
and reset on a failed step, resized when the device split moves, slots copied, and
``check_tree``, the check that every state and KV page the radix tree holds is that of the
tree's own token path (a draft token or a stale row in the tree fails it)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from mambacache.cache.base import CacheBase


class DataflowError(AssertionError):
    """A step read a state or KV entry that does not hold the prefix it needs."""


class ShadowPools:
    """Pool-wide operations of ``ShadowRunner`` (module docstring)."""

    # set by ShadowRunner.__init__
    page_size: int
    kv_len: np.ndarray
    kv_key: np.ndarray
    slot_len: np.ndarray
    slot_key: np.ndarray
    _future: np.ndarray
    _prev_multi: list | None
    _lost: bool
    host_kv: dict
    host_slot: dict
    _loads: dict

    # ---- failures and resizes ------------------------------------------------------------------
    def pools_lost(self) -> bool:
        return self._lost

    def reset_pools(self) -> None:
        for a in (self.kv_len, self.kv_key, self.slot_len, self.slot_key):
            a[:] = 0
        self._future, self._prev_multi = np.zeros(0, np.int32), None
        self._lost = False
        self.host_kv, self.host_slot = {}, {}  # [host tier] the cache starts empty too
        self._loads = {}

    def resize_pools(self, num_pages: int, num_slots: int, *, warm: bool = False) -> None:
        """[rebalance] ``ModelRunner.resize_pools``: rows past a shrink are forgotten, new rows
        hold nothing (length 0), so a read of a row that changed role before it was written
        again fails as any stale read."""
        def rows(a: np.ndarray, n: int) -> np.ndarray:
            out = np.zeros(n, a.dtype)
            out[:min(n, len(a))] = a[:n]
            return out

        ps = self.page_size
        self.kv_len = rows(self.kv_len, (num_pages + 1) * ps)
        self.kv_key = rows(self.kv_key, (num_pages + 1) * ps)
        self.slot_len = rows(self.slot_len, num_slots + 1)
        self.slot_key = rows(self.slot_key, num_slots + 1)

    def copy_slots(self, pairs: Sequence[tuple[int, int]]) -> None:
        """``ModelRunner.copy_slots``: the state at ``dst`` becomes the one at ``src``."""
        for src, dst in pairs:
            self.slot_len[dst], self.slot_key[dst] = self.slot_len[src], self.slot_key[src]

    def copy_pages(self, pairs: Sequence[tuple[int, int]]) -> None:
        """``ModelRunner.copy_pages``: the KV at page ``dst`` becomes the one at ``src``."""
        ps = self.page_size
        for src, dst in pairs:
            d, s = slice(dst * ps, (dst + 1) * ps), slice(src * ps, (src + 1) * ps)
            self.kv_len[d], self.kv_key[d] = self.kv_len[s], self.kv_key[s]

    def check_tree(self, cache: CacheBase) -> None:
        """Raise ``DataflowError`` unless every state slot and KV page the radix tree holds is
        the state / KV of the tree's token path to it (no draft token, no stale row); the same
        of the host tree's host copies with a host tier (``ShadowTier.check_host_tree``)."""
        todo = [(root, np.zeros(0, np.int32)) for root in getattr(cache, "roots", {}).values()]
        loading, loading_pages = self.pending_load_ids()  # [host tier] rows still to come
        while todo:
            node, path = todo.pop()
            path = np.concatenate([path, node.key]) if len(node.key) else path
            if len(path):
                keys = self.prefix_keys(path)
                d = node.depth
                state = (self.slot_len[node.slot], self.slot_key[node.slot]) \
                    if node.slot is not None and node.slot not in loading else None
                if state is not None and state != (d, keys[d - 1]):
                    raise DataflowError(f"tree node at depth {d} has slot {node.slot} holding "
                                        f"the state after {self.slot_len[node.slot]} tokens "
                                        "of another prefix")
                first = d - len(node.key)
                pos = np.arange(first, first + len(node.pages) * self.page_size)
                pos = pos[pos < d]
                pages = np.asarray(node.pages, np.int64)[(pos - first) // self.page_size]
                locs = pages * self.page_size + pos % self.page_size
                if loading_pages:
                    keep = ~np.isin(pages, list(loading_pages))
                    locs, pos = locs[keep], pos[keep]
                if (self.kv_key[locs] != keys[pos]).any():
                    raise DataflowError(f"tree node at depth {d}: KV pages {node.pages.tolist()} "
                                        "hold another prefix")
            todo.extend((child, path) for child in node.children.values())
        if getattr(cache, "host_tier", None) is not None:  # [host tier] the host tree too
            self.check_host_tree(cache.host_tier.host)

