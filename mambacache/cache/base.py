"""The interface every prefix cache implements, and the registry ``make_cache`` chooses from.

``CacheBase`` owns the two allocators (``self.pages``: KV pages, ``self.slots``: state slots) and
implements the allocation API on top of the subclass's eviction:

* ``alloc_pages(n)`` / ``alloc_slots(n)``: ``int32[n]`` ids held by the caller, evicting as the
  policy says when the free list is short; ``None`` when even eviction cannot free enough.
  ``alloc_page()`` / ``alloc_slot()``: one id as a Python int (a decode row's page at page
  size 1, a request's running slot or one snapshot's slot).
* ``alloc_speculative_slots(n, evict)``: up to ``n`` slots for speculative snapshots
  (``int32[k]``, ``k <= n``), from free slots and from evicting at most ``evict`` other
  speculative states (never a firm one).
* ``free_pages(ids)`` / ``free_slots(ids)``: give back ids the caller holds.
* ``available_pages()`` / ``available_slots()``: free + evictable now (for admission).
* ``record_skipped(n)``: count snapshots that were planned but got no slot.
* ``stats()``: counts, see ``CacheBase.stats``.

With a ``budget`` (``cache/budget.py``: one byte limit for both pools) the allocations also keep
``pages in use * page_bytes + slots in use * slot_bytes <= limit_bytes``: a short budget evicts
through ``evict_bytes`` (KV and states in one order, the subclass's), and ``available_*`` count
free + evictable bytes. Without one, each pool is bounded by its id count alone (as before).

Subclasses implement ``match_prefix``, ``insert``, ``lock``, ``unlock``, ``evict_pages``,
``evict_slots``, ``evictable_pages``, ``evictable_slots``, ``locked_pages``, ``locked_slots``
and ``check_integrity``; they register under a key of ``CACHE_CLASSES`` (``True``: the radix
cache, ``False``: the disabled cache).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mambacache.cache.allocator import IdAllocator
from mambacache.cache.budget import ByteBudget

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
    # the host tier behind this cache (``cache/host_tier.py``; set by ``HostTier``), or None
    host_tier: Any = None
    # [rebalance] ``cache/rebalance.SplitTuner`` fed by matches and inserts, or None
    split_tuner: Any = None

    def __init__(self, num_pages: int, num_slots: int, page_size: int = 1,
                 budget: ByteBudget | None = None):
        if not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        self.page_size = page_size
        self.pages = IdAllocator(num_pages, "KV page")
        self.slots = IdAllocator(num_slots, "state slot")
        self.budget = budget
        self.counters = {"snapshots_kept": 0, "snapshots_evicted": 0, "snapshots_skipped": 0,
                         "snapshots_rejected": 0, "pages_evicted": 0,
                         "snapshots_promoted": 0, "snapshots_demoted": 0}
        self.peak_kv_bytes = 0
        self.peak_state_bytes = 0
        self.peak_bytes = 0

    # --------------------------------------------------------------------------- bytes
    def kv_bytes_held(self) -> int:
        """Bytes of the KV pages in use (held by requests or in the tree); 0 without a budget."""
        return (self.pages.num_usable - self.pages.num_free) * self.budget.page_bytes \
            if self.budget is not None else 0

    def state_bytes_held(self) -> int:
        return (self.slots.num_usable - self.slots.num_free) * self.budget.slot_bytes \
            if self.budget is not None else 0

    def free_bytes(self) -> int:
        """Budget bytes not in use (``limit - KV held - states held``)."""
        return self.budget.limit_bytes - self.kv_bytes_held() - self.state_bytes_held()

    def evictable_bytes(self) -> int:
        b = self.budget
        return self.evictable_pages() * b.page_bytes + self.evictable_slots() * b.slot_bytes

    def _note_peak(self) -> None:
        kv, st = self.kv_bytes_held(), self.state_bytes_held()
        self.peak_kv_bytes = max(self.peak_kv_bytes, kv)
        self.peak_state_bytes = max(self.peak_state_bytes, st)
        self.peak_bytes = max(self.peak_bytes, kv + st)

    def _room(self, alloc: IdAllocator, unit_bytes: int) -> int:
        """Ids of ``alloc`` that can be taken without evicting (free ids and free bytes)."""
        if self.budget is None:
            return alloc.num_free
        return min(alloc.num_free, self.free_bytes() // unit_bytes)

    def _make_room(self, alloc: IdAllocator, num: int, unit_bytes: int) -> bool:
        """Evict (ids, then bytes) until ``num`` ids of ``alloc`` can be taken; False if even
        eviction cannot (nothing evicted then)."""
        is_pages = alloc is self.pages
        short = num - alloc.num_free
        if short > 0:
            evictable = self.evictable_pages() if is_pages else self.evictable_slots()
            if short > evictable:
                return False
        if self.budget is not None:
            short_bytes = num * unit_bytes - self.free_bytes()
            if short_bytes > 0:
                if short_bytes > self.evictable_bytes():
                    return False
                self.evict_bytes(short_bytes)
            short = num - alloc.num_free
        if short > 0:
            (self.evict_pages if is_pages else self.evict_slots)(short)
        return alloc.num_free >= num and (self.budget is None
                                           or self.free_bytes() >= num * unit_bytes)

    # --------------------------------------------------------------------------- allocation
    def alloc_pages(self, num: int) -> np.ndarray | None:
        """``int32[num]`` KV pages for the caller, evicting if needed; ``None`` if impossible."""
        return self._alloc(self.pages, num)

    def alloc_page(self) -> int | None:
        """``alloc_pages(1)``'s id as a Python int (the same id, the same eviction); None if
        impossible."""
        return self._alloc_one(self.pages)

    def alloc_slot(self) -> int | None:
        """``alloc_slots(1)``'s id as a Python int (the same id, the same eviction); None if
        impossible."""
        return self._alloc_one(self.slots)

    def _alloc_one(self, alloc: IdAllocator) -> int | None:
        if self.budget is None and alloc.num_free:
            return alloc.alloc_one()
        ids = self._alloc(alloc, 1)
        return None if ids is None else int(ids[0])

    def alloc_slots(self, num: int) -> np.ndarray | None:
        """``int32[num]`` state slots for the caller, evicting if needed; ``None`` if impossible."""
        return self._alloc(self.slots, num)

    def _alloc(self, alloc: IdAllocator, num: int) -> np.ndarray | None:
        is_pages = alloc is self.pages
        if self.budget is None:
            short = num - alloc.num_free
            if short > 0:
                if short > (self.evictable_pages() if is_pages else self.evictable_slots()):
                    return None
                (self.evict_pages if is_pages else self.evict_slots)(short)
            return alloc.alloc(num)
        unit = self.budget.page_bytes if is_pages else self.budget.slot_bytes
        if not self._make_room(alloc, num, unit):
            return None
        ids = alloc.alloc(num)
        self._note_peak()
        return ids

    def alloc_speculative_slots(self, num: int, evict: int | None = None) -> np.ndarray:
        """``int32[k]``, ``k <= num``: slots for speculative snapshots, free ones only here (the
        radix cache also evicts other speculative states for them)."""
        slot_bytes = self.budget.slot_bytes if self.budget is not None else 1
        got = self.slots.alloc(min(num, self._room(self.slots, slot_bytes)))
        if self.budget is not None:
            self._note_peak()
        return got

    def evict_bytes(self, num_bytes: int) -> int:
        """Free at least ``num_bytes`` of the budget if possible (KV and states in one order);
        returns the bytes freed. Only caches with a tree evict."""
        return 0

    def evict_above(self, page_limit: int, slot_limit: int) -> None:
        """Drop unlocked tree entries holding a page above ``page_limit`` or a slot above
        ``slot_limit`` (the device split moving); only caches with a tree hold any."""

    def free_pages(self, ids) -> None:
        self.pages.free(ids)

    def free_slots(self, ids) -> None:
        self.slots.free(ids)

    def available_pages(self) -> int:
        """Pages that could be taken now (free + evictable, ids and bytes)."""
        ids = self.pages.num_free + self.evictable_pages()
        if self.budget is None:
            return ids
        return min(ids, (self.free_bytes() + self.evictable_bytes()) // self.budget.page_bytes)

    def available_slots(self) -> int:
        ids = self.slots.num_free + self.evictable_slots()
        if self.budget is None:
            return ids
        return min(ids, (self.free_bytes() + self.evictable_bytes()) // self.budget.slot_bytes)

    def usage(self) -> tuple[float, float]:
        """``(token_usage, mamba_usage)`` of ``stats()`` without building it: the protected
        share of each pool (locked in the tree + held by requests)."""
        return (self.pages.share_protected(self.locked_pages()),
                self.slots.share_protected(self.locked_slots()))

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
            out[f"{name}_total"] = alloc.num_usable  # ids above a limit, not in use: none
            out[f"{name}_free"] = alloc.num_free
            out[f"{name}_evictable"] = evictable
            out[f"{name}_protected"] = locked + alloc.num_held
            out[f"{name}_held"] = alloc.num_held
            out[f"{name}_tree"] = alloc.num_tree
        out["token_usage"] = out["pages_protected"] / out["pages_total"]
        out["mamba_usage"] = out["slots_protected"] / out["slots_total"]
        out.update(self.counters)
        if self.budget is not None:
            out.update(self.budget_stats())
        return out

    def budget_stats(self) -> dict[str, int]:
        """The byte budget: its limit, the unit sizes, bytes held now and at the peak ({} without
        a budget)."""
        b = self.budget
        if b is None:
            return {}
        return {"memory_bytes": b.limit_bytes, "state_bytes": b.slot_bytes,
                "kv_bytes_per_page": b.page_bytes,
                "kv_bytes_held": self.kv_bytes_held(), "state_bytes_held": self.state_bytes_held(),
                "peak_kv_bytes_held": self.peak_kv_bytes,
                "peak_state_bytes_held": self.peak_state_bytes,
                "peak_bytes_held": self.peak_bytes}

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
        if self.budget is not None and self.free_bytes() < 0:
            raise AssertionError(
                f"KV {self.kv_bytes_held()} + states {self.state_bytes_held()} bytes exceed the "
                f"budget of {self.budget.limit_bytes} bytes")
