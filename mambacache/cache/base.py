"""The interface every prefix cache implements, and the registry ``make_cache`` chooses from.

``CacheBase`` owns the two allocators (``self.pages``: KV pages, ``self.slots``: state slots) and
implements the allocation API on top of the subclass's eviction:

* ``alloc_pages(n)`` / ``alloc_slots(n)``: ``int32[n]`` ids held by the caller, evicting as the
  policy says when the free list is short; ``None`` when even eviction cannot free enough.
* ``alloc_speculative_slots(n, evict)``: up to ``n`` slots for speculative snapshots
  (``int32[k]``, ``k <= n``), from free slots and from evicting at most ``evict`` other
  speculative states (never a firm one).
* ``free_pages(ids)`` / ``free_slots(ids)``: give back ids the caller holds.
* ``available_pages()`` / ``available_slots()``: free + evictable now (for admission).
* ``record_skipped(n)``: count snapshots that were planned but got no slot.
* ``stats()``: counts, see ``CacheBase.stats``.

Subclasses implement ``match_prefix``, ``insert``, ``lock``, ``unlock``, ``evict_pages``,
``evict_slots``, ``evictable_pages``, ``evictable_slots``, ``locked_pages``, ``locked_slots``
and ``check_integrity``; they register under a key of ``CACHE_CLASSES`` (``True``: the radix
cache, ``False``: the disabled cache).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mambacache.cache.allocator import IdAllocator

CACHE_CLASSES: dict[bool, type[CacheBase]] = {}


def register_cache(enable: bool):
    """Class decorator: ``make_cache(enable=enable)`` builds this class."""

    def wrap(cls):
        CACHE_CLASSES[enable] = cls
        return cls

    return wrap


class CacheBase:
    """Allocators + accounting shared by every cache (see the module docstring)."""

    # plan the prompt_len - 1 snapshot and checkpoints (``snapshot_plan.assign_snapshot_slots``)
    speculative_states = True

    def __init__(self, num_pages: int, num_slots: int, page_size: int = 1):
        if not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        self.page_size = page_size
        self.pages = IdAllocator(num_pages, "KV page")
        self.slots = IdAllocator(num_slots, "state slot")
        self.counters = {"snapshots_kept": 0, "snapshots_evicted": 0, "snapshots_skipped": 0,
                         "snapshots_rejected": 0, "pages_evicted": 0,
                         "snapshots_promoted": 0}

    # --------------------------------------------------------------------------- allocation
    def alloc_pages(self, num: int) -> np.ndarray | None:
        """``int32[num]`` KV pages for the caller, evicting if needed; ``None`` if impossible."""
        short = num - self.pages.num_free
        if short > 0:
            if short > self.evictable_pages():
                return None
            self.evict_pages(short)
        return self.pages.alloc(num)

    def alloc_slots(self, num: int) -> np.ndarray | None:
        """``int32[num]`` state slots for the caller, evicting if needed; ``None`` if impossible."""
        short = num - self.slots.num_free
        if short > 0:
            if short > self.evictable_slots():
                return None
            self.evict_slots(short)
        return self.slots.alloc(num)

    def alloc_speculative_slots(self, num: int, evict: int | None = None) -> np.ndarray:
        """``int32[k]``, ``k <= num``: slots for speculative snapshots, free ones only here (the
        radix cache also evicts other speculative states for them)."""
        return self.slots.alloc(min(num, self.slots.num_free))

    def free_pages(self, ids) -> None:
        self.pages.free(ids)

    def free_slots(self, ids) -> None:
        self.slots.free(ids)

    def available_pages(self) -> int:
        return self.pages.num_free + self.evictable_pages()

    def available_slots(self) -> int:
        return self.slots.num_free + self.evictable_slots()

    def record_skipped(self, num: int = 1) -> None:
        self.counters["snapshots_skipped"] += num

    # --------------------------------------------------------------------------- to implement
    def evictable_pages(self) -> int:
        raise NotImplementedError

    def evictable_slots(self) -> int:
        raise NotImplementedError

    def locked_pages(self) -> int:
        raise NotImplementedError

    def locked_slots(self) -> int:
        raise NotImplementedError

    def evict_pages(self, num: int) -> int:
        raise NotImplementedError

    def evict_slots(self, num: int) -> int:
        raise NotImplementedError

    # --------------------------------------------------------------------------- reporting
    def stats(self) -> dict[str, Any]:
        """Counts. ``*_protected`` = locked in the tree + held by requests; for each pool
        ``free + evictable + protected == total``. ``*_tree`` = owned by the tree."""
        out: dict[str, Any] = {}
        for name, alloc, evictable, locked in (
            ("pages", self.pages, self.evictable_pages(), self.locked_pages()),
            ("slots", self.slots, self.evictable_slots(), self.locked_slots()),
        ):
            out[f"{name}_total"] = alloc.num_ids
            out[f"{name}_free"] = alloc.num_free
            out[f"{name}_evictable"] = evictable
            out[f"{name}_protected"] = locked + alloc.num_held
            out[f"{name}_held"] = alloc.num_held
            out[f"{name}_tree"] = alloc.num_tree
        out["token_usage"] = out["pages_protected"] / out["pages_total"]
        out["mamba_usage"] = out["slots_protected"] / out["slots_total"]
        out.update(self.counters)
        return out

    def _check_accounting(self) -> None:
        """``free + evictable + protected == total`` per pool, allocator audits included."""
        self.pages.check()
        self.slots.check()
        s = self.stats()
        for name in ("pages", "slots"):
            parts = s[f"{name}_free"] + s[f"{name}_evictable"] + s[f"{name}_protected"]
            if parts != s[f"{name}_total"]:
                raise AssertionError(
                    f"{name}: free {s[name + '_free']} + evictable {s[name + '_evictable']} + "
                    f"protected {s[name + '_protected']} != total {s[name + '_total']}"
                )
