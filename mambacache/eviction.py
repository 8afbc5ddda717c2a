"""Eviction policies of the radix cache, chosen by name through ``POLICIES`` / ``make_policy``.

A policy only chooses; the cache evicts. Two questions, each answered with a list of candidate
nodes in eviction order, enough to cover the request when possible (the cache skips candidates
that became invalid and asks again if it still needs more):

* ``page_victims(cache, num_pages)``: unlocked leaves (``full_lock_ref == 0``, no children).
  The cache removes each whole (KV and state), then childless tombstones upward.
* ``state_victims(cache, num_slots)``: nodes with a state and ``mamba_lock_ref == 0``. The cache
  turns an internal one into a tombstone (KV kept) and removes a leaf whole.

``lru``: least recently used first (``cache.lru_all`` / ``cache.lru_state``, oldest first).

``flop_aware`` (after Marconi, MLSys 2025): candidates are nodes with at most one child; each gets
``score = recency + alpha * efficiency`` where recency is the candidate's rank from oldest (0) to
newest (1) and efficiency is the prefill FLOPs a hit on the node saves per byte the eviction frees,
normalised to [0, 1] over the candidates. Lowest score goes first. FLOPs saved by a state at depth
``d``: ``d * (1 + d / attn_quadratic_tokens)`` (linear layers ~ d, attention ~ d^2); bytes freed:
``state_bytes_in_tokens`` (a state's size in tokens of KV) plus the edge's KV if a leaf goes whole.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mambacache.radix_node import Node

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
        out = []
        for node in cache.lru_state:
            if node.mamba_lock_ref == 0:
                out.append(node)
                if len(out) >= num_slots:
                    break
        return out


@register_policy("flop_aware")
class FlopAwarePolicy(EvictionPolicy):
    """Marconi-style: recency plus FLOPs saved per byte held (see the module docstring)."""

    def __init__(self, alpha: float = 1.0, state_bytes_in_tokens: float = 256.0,
                 attn_quadratic_tokens: float = 8192.0):
        if alpha < 0 or state_bytes_in_tokens <= 0 or attn_quadratic_tokens <= 0:
            raise ValueError(
                f"flop_aware needs alpha >= 0 and positive sizes, got alpha={alpha}, "
                f"state_bytes_in_tokens={state_bytes_in_tokens}, "
                f"attn_quadratic_tokens={attn_quadratic_tokens}"
            )
        self.alpha = alpha
        self.state_tokens = state_bytes_in_tokens
        self.attn_tokens = attn_quadratic_tokens

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
        top = max(eff) or 1.0
        last = len(candidates) - 1
        scores = [i / last + self.alpha * e / top for i, e in enumerate(eff)]
        order = sorted(range(len(candidates)), key=scores.__getitem__)
        return [candidates[i] for i in order]

    def page_victims(self, cache: Any, num_pages: int) -> list[Node]:
        cands = [n for n in cache.lru_all if not n.children and n.full_lock_ref == 0]
        out, covered = [], 0
        for node in self._ranked(cache, cands):
            out.append(node)
            covered += len(node.pages)
            if covered >= num_pages:
                break
        return out

    def state_victims(self, cache: Any, num_slots: int) -> list[Node]:
        cands = [n for n in cache.lru_state if n.mamba_lock_ref == 0 and len(n.children) <= 1]
        if not cands:  # every unlocked state sits on a branch point: fall back to those
            cands = [n for n in cache.lru_state if n.mamba_lock_ref == 0]
        return self._ranked(cache, cands)[:num_slots]
