"""``DisabledCache``: the radix cache's interface with caching off (``make_cache(enable=False)``).

It never matches (``cached_len == 0``, read the zero state), ``insert`` frees every page and slot
it is given, ``lock``/``unlock`` do nothing and nothing is ever evictable, so the engine runs the
same code path with or without the cache.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mambacache.cache.base import CacheBase, register_cache
from mambacache.cache.node import InsertResult, MatchResult, make_root

_EMPTY = np.zeros(0, dtype=np.int32)


@register_cache(False)
class DisabledCache(CacheBase):
    """No tree: allocators only (see the module docstring)."""

    def __init__(self, num_pages: int, num_slots: int, page_size: int = 1,
                 eviction: str = "lru", budget: Any = None, **policy_kwargs: Any):
        super().__init__(num_pages, num_slots, page_size, budget)
        self._root = make_root()

    def match_prefix(self, prompt_ids, extra_key: Any = None) -> MatchResult:
        return MatchResult(0, _EMPTY, None, self._root, 0)

    def insert(self, token_ids, page_ids, snapshots: dict[int, int] | None = None,
               extra_key: Any = None, *, below: Any = None) -> InsertResult:
        """Frees every id passed (``below``, an extension's start, is this cache's root)."""
        snaps = snapshots or {}
        pages = np.asarray(page_ids, dtype=np.int32)
        self.pages.free(pages)
        self.slots.free(np.array(list(snaps.values()), dtype=np.int32))
        self.counters["snapshots_rejected"] += len(snaps)
        return InsertResult(0, self._root, (), tuple(sorted(snaps)), 0, len(pages))

    def lock(self, node: Any) -> None:
        pass

    def unlock(self, node: Any) -> None:
        pass

    def evictable_pages(self) -> int:
        return 0

    def evictable_slots(self) -> int:
        return 0

    def locked_pages(self) -> int:
        return 0

    def locked_slots(self) -> int:
        return 0

    def evict_pages(self, num: int) -> int:
        return 0

    def evict_slots(self, num: int) -> int:
        return 0

    def check_integrity(self) -> None:
        if self.pages.num_tree or self.slots.num_tree:
            raise AssertionError(
                f"disabled cache owns {self.pages.num_tree} pages / {self.slots.num_tree} slots"
            )
        self._check_accounting()
