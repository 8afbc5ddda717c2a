"""Drafters: where speculative draft tokens come from (host side, a registry by method name).

A drafter proposes up to ``k`` tokens to follow a request's verified tokens; the verify step
(``engine/speculative.py``) decides which of them the target model agrees with. Drafts are
deterministic guesses (a one-hot draft distribution), so sampling the target at each position
and accepting while it equals the draft is exact rejection sampling. A drafter never sees an
unverified token: it is handed ``Request.token_ids`` (prompt + accepted outputs) only.

``ngram`` (prompt lookup): take the last ``n`` tokens, ``n`` from ``ngram_max`` down to
``ngram_min``; find their most recent earlier occurrence in the request's own prompt + output;
propose what followed it. No model, no device.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from mambacache.config import SpeculativeConfig


class NgramDrafter:
    """Prompt lookup over the request's own tokens (``ngram_min..ngram_max``-token suffixes)."""

    def __init__(self, cfg: SpeculativeConfig):
        self.ngram_min, self.ngram_max = cfg.ngram_min, cfg.ngram_max

    def propose(self, tokens: np.ndarray, k: int) -> list[int]:
        """Up to ``k`` draft tokens to follow ``tokens`` (``int32[n]``); ``[]`` if no match.

        For the longest suffix length ``n`` with an earlier occurrence, the latest occurrence
        wins (recent text predicts repetition best); its continuation is copied, periodically
        when it runs into the end.
        """
        total = len(tokens)
        for n in range(min(self.ngram_max, total - 1), self.ngram_min - 1, -1):
            # windows starting at 0..total-n-1: each leaves at least one token after it
            windows = sliding_window_view(tokens[:total - 1], n)
            hits = np.flatnonzero((windows == tokens[total - n:]).all(axis=1))
            if hits.size:
                return _continue(tokens.tolist(), int(hits[-1]) + n, k)
        return []


def _continue(tokens: list[int], start: int, k: int) -> list[int]:
    """``k`` tokens copied from ``start`` on; a copy running into the end continues from its own
    drafts (the text repeats with period ``len(tokens) - start``)."""
    out = tokens[start:start + k]
    period = len(tokens) - start
    while len(out) < k:
        out.append(out[len(out) - period] if len(out) >= period else tokens[start + len(out)])
    return out


#: method name -> drafter factory. ``mtp`` needs the model's MTP head (not built yet).
DRAFTERS: dict[str, Callable[[SpeculativeConfig], NgramDrafter]] = {"ngram": NgramDrafter}


def make_drafter(cfg: SpeculativeConfig) -> NgramDrafter:
    """The drafter for ``cfg.method``; ``ValueError`` for a method without one."""
    if cfg.method not in DRAFTERS:
        raise ValueError(f"speculative.method {cfg.method!r} has no drafter; available: "
                         f"{sorted(DRAFTERS)}")
    return DRAFTERS[cfg.method](cfg)
