"""Where the device split between KV pages and state slots should move: the splits and the
decision (host only, no JAX; the move itself is ``engine/runners/rebalance.py``).

Device pools are two arrays per layer kind, so a byte budget is split into a page count and a
slot count. ``device_splits`` gives the few splits a model's pools may take: the formula's
state share (``budget.device_state_share``) and its neighbours ``REBALANCE_STEP`` of the bytes
apart, each within the budget, each holding one request of the context and two slots per
running request; sorted by slot count. Each split is one set of step programs (the pool rows
are part of a program's shapes), so there are few.

``SplitTuner`` decides, from the workload, which split pays: every ``every`` admissions it
replays the last ``window`` finished requests (``tuning.RequestLog``, fed by the cache's match
and insert, as the alpha tuner's) on shadow caches with fixed pools at the current split and at
its neighbours, with the cache's eviction policy and the requests in flight the engine had; a
neighbour that hits more than the current split by more than ``margin`` (relative) for
``confirm`` tunings in a row is the target. So a move follows which pool's evictions lose more
hits per byte, measured, with hysteresis: one neighbour at a time, and not on one noisy replay.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mambacache.cache.budget import DEVICE_STATE_SHARE_RANGE
from mambacache.cache.tuning import RequestLog, shadow_hits

if TYPE_CHECKING:
    from mambacache.cache.radix import MambaRadixCache

#: the splits' state shares: the formula's, and this many bytes of the budget apart
REBALANCE_STEP = 0.15
#: neighbours on each side of the formula's split
REBALANCE_NEIGHBOURS = 1
#: the tuner's cadence: every 64 admissions on the last 128 finished requests (3 shadow
#: replays of 128 requests: 6 replayed requests per admission, paid only with rebalancing on);
#: a neighbour must win by 2 % of the hits twice in a row, so a move needs 128 admissions
SPLIT_TUNE_EVERY, SPLIT_TUNE_WINDOW, SPLIT_TUNE_MARGIN, SPLIT_TUNE_CONFIRM = 64, 128, 0.02, 2


def device_splits(usable_bytes: int, page_bytes: int, slot_bytes: int, share: float, *,
                  min_pages: int, min_slots: int) -> tuple[tuple[tuple[int, int], ...], int]:
    """``((pages, slots), ...)`` sorted by slots, and the index of the formula's split
    (``share`` of ``usable_bytes`` to states): the splits a device's pools may move between
    (module docstring). Each has ``pages * page_bytes + slots * slot_bytes <= usable_bytes``,
    ``pages >= min_pages`` and ``slots >= min_slots``; the formula's split is always one."""
    lo, hi = DEVICE_STATE_SHARE_RANGE
    out: set[tuple[int, int]] = set()
    base = None
    for k in range(-REBALANCE_NEIGHBOURS, REBALANCE_NEIGHBOURS + 1):
        s = share if k == 0 else min(hi, max(lo, share + k * REBALANCE_STEP))
        slots = int(usable_bytes * s) // slot_bytes
        pages = (usable_bytes - slots * slot_bytes) // page_bytes
        if k == 0:
            base = (pages, slots)
        elif pages < min_pages or slots < min_slots:
            continue
        out.add((pages, slots))
    splits = tuple(sorted(out, key=lambda ps: ps[1]))
    return splits, splits.index(base)


class SplitTuner(RequestLog):
    """Request log + shadow replays at the current split and its neighbours (module
    docstring)."""

    def __init__(self, window: int = SPLIT_TUNE_WINDOW, every: int = SPLIT_TUNE_EVERY,
                 margin: float = SPLIT_TUNE_MARGIN, confirm: int = SPLIT_TUNE_CONFIRM):
        super().__init__(window, every)
        if margin < 0 or confirm < 1:
            raise ValueError(f"split tuning needs margin >= 0 and confirm >= 1, got {margin}, "
                             f"{confirm}")
        self.margin, self.confirm = margin, confirm
        self.due = False  # set by ``record_match``, read between steps by the engine
        self._last, self._wins = None, 0
        self.history: list[tuple[int, int, dict[int, int]]] = []  # (matches, target, hits)

    def record_match(self, prompt: Any) -> bool:
        due = super().record_match(prompt)
        self.due = self.due or due
        return due

    def tune(self, cache: MambaRadixCache, splits: tuple[tuple[int, int], ...],
             current: int) -> int:
        """The split to move to (``current`` to stay): see the module docstring."""
        self.due = False
        reqs = list(self.requests)
        conc = self.concurrency()
        alpha = float(getattr(cache.policy, "alpha", 0.0))
        hits = {i: shadow_hits(cache, reqs, len(reqs) // 2, alpha, conc, *splits[i])
                for i in (current - 1, current, current + 1) if 0 <= i < len(splits)}
        best = max(hits, key=lambda i: (hits[i], i == current))
        if hits[best] <= hits[current] * (1 + self.margin):
            best = current
        self._wins = self._wins + 1 if best == self._last else 1
        self._last = best
        target = best if best == current or self._wins >= self.confirm else current
        self.history.append((self.matches, target, hits))
        return target
