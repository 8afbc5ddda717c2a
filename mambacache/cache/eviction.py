"""Eviction policies of the radix cache, chosen by name through ``POLICIES`` / ``make_policy``.

A policy only chooses; the cache evicts. Two questions, each answered with a list of candidate
nodes in eviction order, enough to cover the request when possible (the cache skips candidates
that became invalid and asks again if it still needs more):

* ``page_victims(cache, num_pages)``: unlocked leaves (``full_lock_ref == 0``, no children).
  The cache removes each whole (KV and state), then childless tombstones upward.
* ``state_victims(cache, num_slots)``: nodes with a state and ``mamba_lock_ref == 0``. The cache
  turns an internal one into a tombstone (KV kept) and removes a leaf whole.
* ``byte_victims(cache, num_bytes)`` (a shared byte budget, ``cache/budget.py``): both kinds in
  one order: unlocked leaves (removed whole: KV + state) and unlocked states of internal nodes
  (dropped), until their bytes cover ``num_bytes``.

``lru``: least recently used first (``cache.lru_all`` / ``cache.lru_state``, oldest first).

``flop_aware`` (after Marconi, MLSys 2025): candidates are nodes with at most one child; each gets
``score = recency + alpha * efficiency`` where recency is the candidate's rank from oldest (0) to
newest (1) and efficiency is the prefill FLOPs a hit on the node saves per byte the eviction frees,
normalised to [0, 1] over the candidates. Lowest score goes first. FLOPs saved by a state at depth
``d``: ``d * (1 + d / attn_quadratic_tokens)`` (linear layers ~ d, attention ~ d^2); bytes freed:
``state_bytes_in_tokens`` (a state's size in tokens of KV) plus the edge's KV if a leaf goes whole.
``alpha = inf`` ranks by the product instead, ``(rank + 1) / n * FLOPs / bytes``: the expected
saving per byte, the chance of a hit taken as the recency rank (a deep old state can outlive a
shallow new one; the host tier's order too, ``saving_per_byte`` below).
Pass ``alpha`` etc. through ``make_cache(..., eviction="flop_aware", alpha=2.0)``. The default
``alpha="auto"`` tunes it online (``tuning.py``: replay of recent requests on shadow caches, one
per candidate alpha of 0, 0.25, 1, 4 and inf, as Marconi does), starting from 0 (recency only).

The cache side, which removes what a policy names, is ``TreeEviction`` (``tree_eviction.py``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from mambacache.cache.node import unlocked_states
from mambacache.cache.tuning import AlphaTuner

if TYPE_CHECKING:
    from mambacache.cache.node import Node

POLICIES: dict[str, type[EvictionPolicy]] = {}


def register_policy(name: str):
    def wrap(cls):
        POLICIES[name] = cls
        cls.name = name
        return cls

    return wrap


def make_policy(name: str, **kwargs: Any) -> EvictionPolicy:
    if name not in POLICIES:
        raise ValueError(f"unknown eviction policy {name!r}; known: {sorted(POLICIES)}")
    return POLICIES[name](**kwargs)


class EvictionPolicy:
    name = "base"

    def page_victims(self, cache: Any, num_pages: int) -> list[Node]:
        raise NotImplementedError

    def state_victims(self, cache: Any, num_slots: int) -> list[Node]:
        raise NotImplementedError

    def byte_victims(self, cache: Any, num_bytes: int) -> list[Node]:
        raise NotImplementedError


def _victim_bytes(node: Node, page_bytes: int, slot_bytes: int) -> int:
    """Budget bytes evicting ``node`` frees now: a leaf's KV and state, an internal state; 0 when
    it cannot be evicted (locked, or an internal node without a state)."""
    if not node.children:
        if node.full_lock_ref:
            return 0
        return len(node.pages) * page_bytes + (slot_bytes if node.slot is not None else 0)
    return slot_bytes if node.slot is not None and not node.mamba_lock_ref else 0


@register_policy("lru")
class LRUPolicy(EvictionPolicy):
    """Least recently used first."""

    def page_victims(self, cache: Any, num_pages: int) -> list[Node]:
        out, covered = [], 0
        for node in cache.lru_all:
            if not node.children and node.full_lock_ref == 0:
                out.append(node)
                covered += len(node.pages)
                if covered >= num_pages:
                    break
        return out

    def state_victims(self, cache: Any, num_slots: int) -> list[Node]:
        return unlocked_states(cache.lru_state, num_slots)

    def byte_victims(self, cache: Any, num_bytes: int) -> list[Node]:
        """Least recently used node first, leaf (KV + state) or internal state alike: a plain
        LRU tree over one byte pool."""
        pb, sb = cache.budget.page_bytes, cache.budget.slot_bytes
        out, covered = [], 0
        for node in cache.lru_all:
            freed = _victim_bytes(node, pb, sb)
            if freed:
                out.append(node)
                covered += freed
                if covered >= num_bytes:
                    break
        return out


@register_policy("flop_aware")
class FlopAwarePolicy(EvictionPolicy):
    """Marconi-style: recency plus FLOPs saved per byte held (see the module docstring)."""

    def __init__(self, alpha: float | str = "auto", state_bytes_in_tokens: float = 256.0,
                 attn_quadratic_tokens: float = 8192.0, rerank_every: int = 32,
                 tune_window: int = 256, tune_every: int = 512, tune_start: float | None = None,
                 tune_confirm: int = 1, tune_margin: float = 0.02):
        self.tuner = None
        if alpha == "auto":
            self.tuner = AlphaTuner(window=tune_window, every=tune_every, start=tune_start,
                                    confirm=tune_confirm, margin=tune_margin)
            alpha = self.tuner.alpha
        if not isinstance(alpha, int | float) or alpha < 0 or state_bytes_in_tokens <= 0 \
                or attn_quadratic_tokens <= 0:
            raise ValueError(
                f"flop_aware needs alpha >= 0 and positive sizes, got alpha={alpha}, "
                f"state_bytes_in_tokens={state_bytes_in_tokens}, "
                f"attn_quadratic_tokens={attn_quadratic_tokens}"
            )
        self.alpha = alpha
        self.state_tokens = state_bytes_in_tokens
        self.attn_tokens = attn_quadratic_tokens
        # Ranking is O(n log n): reuse one ranking for up to ``rerank_every`` victims while the
        # tree got no new state (a new node missing from a reused ranking would outlive older,
        # more valuable ones), dropping entries that went stale (the cache re-validates them).
        self.rerank_every = max(1, rerank_every)
        self._ranked_cache: dict[str, list] = {"pages": [], "states": [], "bytes": []}
        self._uses = {"pages": 0, "states": 0, "bytes": 0}
        self._ranked_at = {"pages": -1, "states": -1, "bytes": -1}  # counters["snapshots_kept"]

    def set_alpha(self, alpha: float) -> None:
        """Adopt a tuned ``alpha``; the cached rankings are rebuilt."""
        if alpha != self.alpha:
            self.alpha = alpha
            self._ranked_cache = {"pages": [], "states": [], "bytes": []}

    def _flops(self, node: Node) -> float:
        d = float(node.depth)
        return d * (1.0 + d / self.attn_tokens) if node.slot is not None else 0.0

    def _bytes(self, node: Node, cache: Any) -> float:
        held = self.state_tokens if node.slot is not None else 0.0
        if not node.children:
            held += len(node.key)
        return max(held, 1.0)

    def _ranked(self, cache: Any, candidates: list[Node]) -> list[Node]:
        if len(candidates) <= 1:
            return candidates
        eff = [self._flops(n) / self._bytes(n, cache) for n in candidates]
        if self.alpha == math.inf:  # expected saving per byte: recency rank x FLOPs per byte
            n = len(candidates)
            scores = [(i + 1) / n * e for i, e in enumerate(eff)]
        else:
            top = max(eff) or 1.0
            last = len(candidates) - 1
            scores = [i / last + self.alpha * e / top for i, e in enumerate(eff)]
        order = sorted(range(len(candidates)), key=scores.__getitem__)
        return [candidates[i] for i in order]

    def _cached(self, kind: str, cache: Any, valid, build, enough) -> list[Node]:
        """Valid candidates from the front of the cached ranking until ``enough(out)``."""
        kept = cache.counters["snapshots_kept"]
        for attempt in range(2):
            ranked = self._ranked_cache[kind]
            if attempt or not ranked or self._uses[kind] >= self.rerank_every \
                    or self._ranked_at[kind] != kept:
                ranked, self._uses[kind] = self._ranked(cache, build()), 0
                self._ranked_at[kind] = kept
            out, i = [], 0
            while i < len(ranked) and not enough(out):
                if valid(ranked[i]):
                    out.append(ranked[i])
                i += 1
            self._ranked_cache[kind] = ranked[i:]
            if out:
                break
        self._uses[kind] += len(out)
        return out

    def page_victims(self, cache: Any, num_pages: int) -> list[Node]:
        if self.alpha == 0:  # recency only: exactly LRU (the tuner's safe candidate)
            return LRUPolicy.page_victims(self, cache, num_pages)

        def valid(n):
            return n.alive and not n.children and n.full_lock_ref == 0

        return self._cached("pages", cache, valid, lambda: [n for n in cache.lru_all if valid(n)],
                            lambda out: sum(len(n.pages) for n in out) >= num_pages)

    def state_victims(self, cache: Any, num_slots: int) -> list[Node]:
        if self.alpha == 0:
            return LRUPolicy.state_victims(self, cache, num_slots)

        def valid(n):
            return n.alive and n.slot is not None and n.mamba_lock_ref == 0

        def build():
            cands = [n for n in cache.lru_state if valid(n) and len(n.children) <= 1]
            # every unlocked state sits on a branch point: fall back to those
            return cands or [n for n in cache.lru_state if valid(n)]

        return self._cached("states", cache, valid, build, lambda out: len(out) >= num_slots)

    def byte_victims(self, cache: Any, num_bytes: int) -> list[Node]:
        """Leaves and internal states ranked together by recency + alpha * FLOPs saved per
        byte freed."""
        if self.alpha == 0:
            return LRUPolicy.byte_victims(self, cache, num_bytes)
        pb, sb = cache.budget.page_bytes, cache.budget.slot_bytes

        def valid(n):
            return n.alive and _victim_bytes(n, pb, sb) > 0

        return self._cached("bytes", cache, valid, lambda: [n for n in cache.lru_all if valid(n)],
                            lambda out: sum(_victim_bytes(n, pb, sb) for n in out) >= num_bytes)


@register_policy("saving_per_byte")
class SavingPerBytePolicy(LRUPolicy):
    """The host tier's order (``cache/host_tier.py``): expected prefill saved per byte held.
    A candidate's expected saving is the FLOPs a hit on it saves (``flop_aware``'s
    ``d * (1 + d / attn_quadratic_tokens)`` at depth ``d``) times its chance of a hit, taken as
    its recency rank ((i + 1) / n, the oldest of n least); divided by the bytes its eviction
    frees (``_victim_bytes``); lowest first. Pages or slots alone (a host pool out of ids, not
    bytes): least recently used first."""

    def __init__(self, attn_quadratic_tokens: float = 8192.0):
        if attn_quadratic_tokens <= 0:
            raise ValueError(f"saving_per_byte needs attn_quadratic_tokens > 0, got "
                             f"{attn_quadratic_tokens}")
        self.attn_tokens = attn_quadratic_tokens

    def byte_victims(self, cache: Any, num_bytes: int) -> list[Node]:
        pb, sb = cache.budget.page_bytes, cache.budget.slot_bytes
        cands = [(n, b) for n in cache.lru_all if (b := _victim_bytes(n, pb, sb))]
        total = len(cands)

        def score(i: int) -> float:
            node, freed = cands[i]
            d = float(node.depth) if node.slot is not None else 0.0
            return (i + 1) / total * d * (1.0 + d / self.attn_tokens) / freed

        out, covered = [], 0
        for i in sorted(range(total), key=score):
            out.append(cands[i][0])
            covered += cands[i][1]
            if covered >= num_bytes:
                break
        return out
