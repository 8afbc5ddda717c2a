"""``Rebalancer``: the device split between KV pages and state slots moving between steps
(``cache.rebalance``; the splits and the decision: ``cache/rebalance.py``).

A move from split A to split B, between two steps (``poll``, called by ``Engine.step`` before
it schedules):

1. **Fence** (host): the allocators hand out ids below ``min(A, B)`` rows only
   (``CacheManager.set_limits``); ids above them still in use finish their lives there.
2. **Drain** (host, each poll): unlocked tree entries above the limits are evicted
   (``evict_above``); a match that reaches one is a miss, so no new lock holds them; running
   requests holding ids above the limits finish (no new id goes there, so the drain ends).
   Nothing running and ids above the limits still in use cannot end: a ``RuntimeError`` with
   the state, never a spin.
3. **Move** (device): the runner resizes its pools one layer at a time, the shrinking pool's
   layers first (``pools.resize_layerwise``): the peak is the budget plus one layer's array.
   Rows past a shrink are gone; rows of a grown pool are new zeros, and their ids were FENCED
   (never handed out), so they are FREE when the limit rises: a byte that changed role (a
   page's bytes now a slot's) is written before it is read, as any FREE row. Then the limits
   rise to B's rows.

Each split's step programs are compiled by ``Engine.warmup`` (it walks every split: ``walk``),
so a move in a timed pass compiles nothing. Not with speculative decoding (scratch slots sit
above the cache's), tensor parallelism or a host tier: a ``ValueError`` at start.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from absl import logging

from mambacache.cache.rebalance import SplitTuner

if TYPE_CHECKING:
    from mambacache.engine.engine import Engine


class Rebalancer:
    """The engine's moving device split (module docstring)."""

    def __init__(self, engine: Engine, tuner: SplitTuner | None = None):
        cfg = engine.cfg
        for bad, what in ((cfg.speculative.enabled, "speculative decoding"),
                          (cfg.parallel.tensor_parallel > 1, "tensor parallelism"),
                          (cfg.cache.host_memory_bytes, "a host tier")):
            if bad:
                raise ValueError(f"cache.rebalance does not support {what} yet: set "
                                 "cache.rebalance = false")
        self.engine = engine
        self.splits: tuple[tuple[int, int], ...] = cfg.cache.device_splits
        self.current = self.splits.index((cfg.cache.num_pages, cfg.cache.num_mamba_slots))
        self.target: int | None = None
        self.moves, self.move_s, self.drain_polls = 0, 0.0, 0
        self.history: list[tuple[int, int, float]] = []  # (from, to, seconds of the device move)
        self.use_tuner(tuner or SplitTuner())

    def use_tuner(self, tuner: SplitTuner) -> None:
        """Decide moves with ``tuner`` from now on (fed by the cache's matches and inserts)."""
        self.tuner = tuner
        self.engine.manager.use_split_tuner(tuner)

    # ---- between steps -----------------------------------------------------------------------
    def poll(self) -> None:
        """Advance a drain, or ask the tuner when it is due; a finished drain moves the pools."""
        if self.target is None:
            if not self.tuner.due:
                return
            k = self.tuner.tune(self.engine.cache, self.splits, self.current)
            if k == self.current:
                return
            self.begin(k)
        self.advance()

    def begin(self, k: int) -> None:
        """Start a move to split ``k``: fence both pools at the smaller of the two splits."""
        if not 0 <= k < len(self.splits) or self.target is not None:
            raise ValueError(f"cannot move to split {k} of {len(self.splits)} (moving to "
                             f"{self.target})")
        (p0, s0), (p1, s1) = self.splits[self.current], self.splits[k]
        self.target = k
        self.engine.manager.set_limits(min(p0, p1), min(s0, s1))

    def advance(self, warm: bool = False) -> bool:
        """Evict what is above the limits; move the device pools once nothing there is in use
        (True), else wait for the running requests (False). ``warm``: the warm-up's move (its
        compiles and time counted there, not here)."""
        e = self.engine
        left = e.manager.evict_above_limits()
        if left:
            if not e.scheduler.running and e.in_flight is None:
                raise RuntimeError(
                    f"moving the device split {self.splits[self.current]} -> "
                    f"{self.splits[self.target]} (pages, slots) cannot finish: {left} ids above "
                    f"the limits {e.manager.limits} are in use with nothing running; "
                    f"{e.manager.describe()}")
            self.drain_polls += 1
            return False
        pages, slots = self.splits[self.target]
        t0 = time.perf_counter()
        e.runner.resize_pools(pages, slots, warm=warm)
        seconds = time.perf_counter() - t0
        e.manager.set_limits(pages, slots)
        if not warm:
            self.history.append((self.current, self.target, seconds))
            logging.info("device split moved %s -> %s (pages, slots) in %.3f s",
                         self.splits[self.current], self.splits[self.target], seconds)
            self.moves += 1
            self.move_s += seconds
        self.current, self.target = self.target, None
        return True

    def move_now(self, k: int, warm: bool = False) -> None:
        """Move to split ``k`` at once (an idle engine, or nothing above the limits in use)."""
        if k == self.current:
            return
        self.begin(k)
        if not self.advance(warm):
            raise RuntimeError(f"moving to split {self.splits[k]} waits for running requests")

    def walk(self) -> list[int]:
        """Splits from the current one down to the first, up to the last and back: every move
        between neighbours once each way (``Engine.warmup`` compiles along it)."""
        c, n = self.current, len(self.splits)
        return list(range(c - 1, -1, -1)) + list(range(1, n)) + list(range(n - 2, c - 1, -1))

    def metrics(self) -> dict[str, Any]:
        return {"device_splits": [list(s) for s in self.splits], "device_split": self.current,
                "split_moves": self.moves, "split_move_s": self.move_s,
                "split_drain_polls": self.drain_polls}
