"""Online tuning of ``flop_aware``'s ``alpha`` (after Marconi): replay recent requests on shadow
caches, one per candidate ``alpha``, and keep the one that hit the most tokens.

The cache reports every ``match_prefix`` (a prompt admitted) and every ``insert`` (the tokens of
a finished request, paired with the pending prompt they extend) to the tuner, which keeps the last
``window`` requests and how many were in flight at each admission. Every ``every`` matches it
replays them on fresh shadow caches of the same size and page size (``type(cache)``, no tuner),
one per candidate ``alpha`` of ``grid``, with as many requests in flight as the median of the
window (8 at a time is a different pressure from one at a time) and the shadow's own snapshot
plan: the first half of the window warms the shadow up under the alpha in use, then the shadow
switches to its candidate and the second half is scored by the prompt tokens its matches hit.
So a switch is scored with its own cost (a tree grown under recency, then ranked by FLOPs per
byte, loses the sessions that come back: docs/bench.md 2026-12-02), and staying is a candidate
like any other. A candidate wins if it beats the alpha in use by more than ``margin``
(relative), else the alpha in use stays: a shadow replay is a noisy predictor. Until the first
tuning ``alpha`` is ``start`` (default ``grid[0]``: 0, exactly LRU).

Host cost: ``len(grid) * window`` replayed requests every ``every`` requests, in the request that
triggers it (the median request pays nothing). Shadows never see locks of running requests, so
they approximate the real pressure; they rank the candidates, nothing more.
"""

from __future__ import annotations

import math
from collections import deque
from typing import TYPE_CHECKING, Any

import numpy as np

from mambacache.cache.replay import replay

if TYPE_CHECKING:
    from mambacache.cache.radix import MambaRadixCache

#: candidate alphas; ``inf``: the product ranking, expected saving per byte (``eviction.py``):
#: ShareGPT chat 1 conv/s, 7B mapping, 5 GB 19.75 -> 23.28 % one at a time (docs/bench.md)
GRID = (0.0, 0.25, 1.0, 4.0, math.inf)


class RequestLog:
    """The last ``window`` finished requests ``(prompt, tokens at finish)`` and the requests in
    flight at each admission; ``record_match`` says when ``every`` admissions have passed. The
    shadow replays of the alpha tuner and of the device split (``rebalance.py``) read it."""

    def __init__(self, window: int = 256, every: int = 512):
        if window < 2 or every < 1:
            raise ValueError(f"a request log needs window >= 2 and every >= 1, got {window}, "
                             f"{every}")
        self.window, self.every = window, every
        self.requests: deque = deque(maxlen=window)  # (prompt, tokens at finish)
        self.pending: deque = deque(maxlen=64)  # prompts matched, not finished yet
        self.inflight: deque = deque(maxlen=window)  # requests in flight at each match
        self.matches = 0

    def record_match(self, prompt: np.ndarray) -> bool:
        """A request was admitted with ``prompt``; True when it is time to tune. A prompt
        matched again before it finished (an admission that found the pools short, or held
        back by the budget's admission cap, retries every step) counts once."""
        pend = self.pending
        if any(p is prompt for p in pend) or (
                pend and len(pend[-1]) == len(prompt) and np.array_equal(pend[-1], prompt)):
            return False
        pend.append(prompt)
        self.inflight.append(len(self.pending))
        self.matches += 1
        return self.matches % self.every == 0 and len(self.requests) >= self.window // 2

    def record_insert(self, tokens: np.ndarray) -> None:
        """A request finished: ``tokens`` extend the most recent pending prompt they start with
        (a mid-flight insert of a prompt's prefix extends none and is ignored)."""
        for i in range(len(self.pending) - 1, -1, -1):
            prompt = self.pending[i]
            if len(tokens) >= len(prompt) - 1 and \
                    tokens[:len(prompt) - 1].tobytes() == prompt[:-1].tobytes():
                del self.pending[i]
                self.requests.append((prompt, tokens))
                return

    def concurrency(self) -> int:
        """Requests in flight the shadows replay with: the median at the recent matches."""
        return max(1, int(np.median(self.inflight))) if self.inflight else 1


class AlphaTuner(RequestLog):
    """Request log + periodic grid search; see the module docstring."""

    def __init__(self, grid: tuple[float, ...] = GRID, window: int = 256, every: int = 512,
                 margin: float = 0.02, start: float | None = None, confirm: int = 1):
        if not grid or any(a < 0 for a in grid) or window < 2 or every < 1:
            raise ValueError(f"alpha tuning needs a non-empty grid of alphas >= 0, window >= 2 "
                             f"and every >= 1, got {grid}, {window}, {every}")
        super().__init__(window, every)
        self.grid = tuple(sorted(grid))
        self.margin = margin
        self.confirm = max(1, confirm)
        self._last, self._wins = None, 0  # the last tuning's winner, its wins in a row
        self.alpha = self.grid[0] if start is None else start
        if self.alpha not in self.grid:
            raise ValueError(f"alpha tuning starts from an alpha of its grid {self.grid}, "
                             f"got {start}")
        self.history: list[tuple[int, float, list[int]]] = []  # (matches, alpha, hits per alpha)

    def tune(self, cache: Any) -> float:
        """Replay the window once per alpha of the grid (``concurrency()`` in flight); the best
        alpha is adopted once it has won ``confirm`` tunings in a row by more than ``margin``
        over ``grid[0]``; a tuning without a clear winner goes back to ``grid[0]``. Returns
        the alpha in use."""
        reqs = list(self.requests)
        conc = self.concurrency()
        hits = [shadow_hits(cache, reqs, len(reqs) // 2, alpha, conc) for alpha in self.grid]
        best = max(range(len(hits)), key=lambda i: (hits[i], -i))
        if hits[best] <= hits[0] * (1 + self.margin):
            best = 0
        self._wins = self._wins + 1 if self.grid[best] == self._last else 1
        self._last = self.grid[best]
        if best == 0 or self._wins >= self.confirm:
            self.alpha = self.grid[best]
        self.history.append((self.matches, self.alpha, hits))
        return self.alpha


def shadow_hits(cache: MambaRadixCache, requests: list, scored_from: int, alpha: float,
                concurrency: int = 1, num_pages: int | None = None,
                num_slots: int | None = None) -> int:
    """Prompt tokens hit by a shadow of ``cache`` over ``requests[scored_from:]`` with
    ``alpha``, after ``requests[:scored_from]`` warmed it up; ``concurrency`` requests in flight,
    snapshots planned by the shadow itself. Pools: ``num_pages`` / ``num_slots`` ids, else the
    cache's own (its id limits: ``IdAllocator.set_limit``)."""
    policy = cache.policy
    budget = getattr(cache, "budget", None)
    state_tokens = getattr(policy, "state_tokens", None) or (
        budget.slot_bytes * cache.page_size / budget.page_bytes if budget else 256.0)
    shadow = type(cache)(num_pages or cache.pages.limit, num_slots or cache.slots.limit,
                         cache.page_size, "flop_aware",
                         speculative_states=cache.speculative_states, alpha=alpha,
                         budget=budget, state_bytes_in_tokens=state_tokens,
                         attn_quadratic_tokens=getattr(policy, "attn_tokens", 8192.0))
    return replay(shadow, requests, concurrency=concurrency,
                  scored_from=scored_from)["cached_tokens"]
