"""Online tuning of ``flop_aware``'s ``alpha`` (after Marconi): replay recent requests on shadow
caches, one per candidate ``alpha``, and keep the one that hit the most tokens.

The cache reports every ``match_prefix`` (a prompt admitted) and every ``insert`` (the tokens of
a finished request, paired with the pending prompt they extend) to the tuner, which keeps the last
``window`` requests. Every ``every`` matches it replays them on fresh shadow caches of the same
size and page size (``type(cache)``, no tuner, ``FlopAwarePolicy`` with a fixed ``alpha`` from
``grid``), one request at a time with the shadow's own snapshot plan: the first half of the
window warms the shadow up, the second half is scored by the prompt tokens its matches hit.
The best ``alpha`` wins if it beats ``grid[0]`` (0: exactly LRU) by more than ``margin``
(relative), else ``grid[0]`` stays: a shadow replay is a noisy predictor, and leaving recency
costs more than it gains when the two are close. Until the first tuning ``alpha`` is ``grid[0]``.

Host cost: ``len(grid) * window`` replayed requests every ``every`` requests, in the request that
triggers it (the median request pays nothing). Shadows never see locks of running requests, so
they approximate the real pressure; they rank the candidates, nothing more.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np

from mambacache.cache.replay import replay

GRID = (0.0, 0.25, 1.0, 4.0)


class AlphaTuner:
    """Request log + periodic grid search; see the module docstring."""

    def __init__(self, grid: tuple[float, ...] = GRID, window: int = 256, every: int = 512,
                 margin: float = 0.02):
        if not grid or any(a < 0 for a in grid) or window < 2 or every < 1:
            raise ValueError(f"alpha tuning needs a non-empty grid of alphas >= 0, window >= 2 "
                             f"and every >= 1, got {grid}, {window}, {every}")
        self.grid = tuple(sorted(grid))
        self.window, self.every, self.margin = window, every, margin
        self.requests: deque = deque(maxlen=window)  # (prompt, tokens at finish)
        self.pending: deque = deque(maxlen=64)  # prompts matched, not finished yet
        self.matches = 0
        self.alpha = self.grid[0]
        self.history: list[tuple[int, float, list[int]]] = []  # (matches, alpha, hits per alpha)

    def record_match(self, prompt: np.ndarray) -> bool:
        """A request was admitted with ``prompt``; True when it is time to ``tune``."""
        self.pending.append(prompt)
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

    def tune(self, cache: Any) -> float:
        """Replay the window once per alpha of the grid; adopt and return the best alpha."""
        reqs = list(self.requests)
        hits = [_replay(cache, reqs, len(reqs) // 2, alpha) for alpha in self.grid]
        best = max(range(len(hits)), key=lambda i: (hits[i], -i))
        if hits[best] <= hits[0] * (1 + self.margin):
            best = 0
        self.alpha = self.grid[best]
        self.history.append((self.matches, self.alpha, hits))
        return self.alpha


def _replay(cache: Any, requests: list, scored_from: int, alpha: float) -> int:
    """Prompt tokens hit by a shadow of ``cache`` with ``alpha`` over ``requests[scored_from:]``,
    one request at a time, snapshots planned by the shadow itself."""
    shadow = type(cache)(cache.pages.num_ids, cache.slots.num_ids, cache.page_size,
                         "flop_aware", speculative_states=cache.speculative_states, alpha=alpha,
                         budget=getattr(cache, "budget", None),
                         state_bytes_in_tokens=cache.policy.state_tokens,
                         attn_quadratic_tokens=cache.policy.attn_tokens)
    return replay(shadow, requests, scored_from=scored_from)["cached_tokens"]
