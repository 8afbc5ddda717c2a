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
Pass ``alpha`` etc. through ``make_cache(..., eviction="flop_aware", alpha=2.0)``. The default
``alpha="auto"`` tunes it online (``tuning.py``: replay of recent requests on shadow caches, one
per candidate alpha, as Marconi does), starting from 0 (recency only).

``TreeEviction`` is the cache side (a mixin of ``MambaRadixCache``): ``evict_pages(n)`` /
``evict_slots(n)`` loop over the policy's candidates until ``n`` are free or nothing is evictable.
A state dropped from a node with one child folds the node into that child (no chains of
tombstones).

Speculative states (``Node.spec``) come before any policy: ``evict_slots`` first drops unlocked
speculative states, least recently used first (``cache.lru_spec``), and only then asks the
policy; KV eviction treats an unlocked speculative state like a tombstone (removing a leaf goes on
upward through it), so a speculative state never keeps KV that the tree without it would free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

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
        out = []
        for node in cache.lru_state:
            if node.mamba_lock_ref == 0:
                out.append(node)
                if len(out) >= num_slots:
                    break
        return out

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


class TreeEviction:
    """The cache side of eviction (mixed into ``MambaRadixCache``): asks ``self.policy`` for
    candidates and removes them, keeping the tree's invariants and counters."""

    def evict_pages(self, num: int) -> int:
        """Free at least ``num`` KV pages if possible (policy order); returns pages freed."""
        freed = 0
        while freed < num:
            victims, start = self.policy.page_victims(self, num - freed), freed
            if not victims:
                break
            for node in victims:
                if node.alive and not node.children and node.full_lock_ref == 0:
                    freed += self._remove_leaf(node)
                    if freed >= num:
                        break
            if freed == start:  # a policy that offers nothing evictable: stop, never spin
                break
        return freed

    def evict_slots(self, num: int) -> int:
        """Free at least ``num`` state slots if possible (policy order); returns slots freed."""
        freed = self._evict_speculative(num) if self.lru_spec else 0
        while freed < num:
            victims, start = self.policy.state_victims(self, num - freed), freed
            if not victims:
                break
            for node in victims:
                if not node.alive or node.slot is None or node.mamba_lock_ref:
                    continue
                if node.children:
                    self._drop_state(node)
                else:
                    self._remove_leaf(node)
                freed += 1
                if freed >= num:
                    break
            if freed == start:
                break
        return freed

    def evict_bytes(self, num_bytes: int) -> int:
        """Free at least ``num_bytes`` of the shared budget if possible: unlocked speculative
        states first, then the policy's ``byte_victims`` (KV and states in one order); returns
        the bytes freed."""
        start = self.free_bytes()
        target = start + num_bytes
        if self.lru_spec:
            self._evict_speculative(-(-num_bytes // self.budget.slot_bytes))
        while self.free_bytes() < target:
            before = self.free_bytes()
            for node in self.policy.byte_victims(self, target - before):
                if not node.alive:
                    continue
                if not node.children:
                    if node.full_lock_ref:
                        continue
                    self._remove_leaf(node)
                elif node.slot is not None and not node.mamba_lock_ref:
                    self._drop_state(node)
                if self.free_bytes() >= target:
                    break
            if self.free_bytes() == before:  # nothing evictable: stop, never spin
                break
        return self.free_bytes() - start

    def evict_above(self, page_limit: int, slot_limit: int) -> None:
        """Drop every unlocked entry holding a slot above ``slot_limit`` (its state) or a page
        above ``page_limit`` (the node's whole subtree, whose prefix needs that KV; unlocked
        when the node is): the ids a shrinking device pool loses (``engine/rebalance.py``).
        Locked entries stay; their requests unlock them."""
        for node in [n for n in self.lru_state if n.slot > slot_limit and not n.mamba_lock_ref]:
            if not node.alive or node.slot is None:
                continue
            if node.children:
                self._drop_state(node, demote=False)
            else:
                self._remove_leaf(node)
        doomed = [n for n in self.lru_all if not n.full_lock_ref and len(n.pages)
                  and int(n.pages.max()) > page_limit]
        for top in doomed:
            if not top.alive:
                continue
            order, todo = [], [top]  # post-order: children before their parent
            while todo:
                node = todo.pop()
                order.append(node)
                todo.extend(node.children.values())
            for node in reversed(order):
                if node.alive and not node.children:
                    self._remove_leaf(node)

    def _evict_speculative(self, num: int) -> int:
        """Free up to ``num`` slots from unlocked speculative states, oldest first; returns the
        slots freed (removing a leaf may drop a speculative parent's state too)."""
        before = self.slots.num_free
        victims = []
        for node in self.lru_spec:
            if node.mamba_lock_ref == 0:
                victims.append(node)
                if len(victims) >= num:
                    break
        for node in victims:
            if not node.spec:  # dropped already, as the parent of an earlier victim
                continue
            if node.children:
                self._drop_state(node)
            else:
                self._remove_leaf(node)
        return self.slots.num_free - before

    def _drop_state(self, node: Node, demote: bool = True) -> None:
        if demote and self.evict_hook is not None and not node.spec:
            self.evict_hook(node)  # a firm internal state: the host tier may keep a copy
        self.slots.release_one(node.slot)
        del self.lru_state[node]
        if node.spec:
            del self.lru_spec[node]
            node.spec = False
        node.slot = None
        self.counters["snapshots_evicted"] += 1
        if len(node.children) == 1:
            self._merge_into_child(node)

    def _merge_into_child(self, node: Node) -> None:
        """Fold a tombstone with one child into that child (which keeps its identity, state,
        locks and recency), so paths do not grow a node per dropped state. The tombstone's
        ``full_lock_ref`` equals the child's, so the locked-page count is unchanged."""
        (child,) = node.children.values()
        parent = node.parent
        child.key = np.concatenate([node.key, child.key])
        child.pages = np.concatenate([node.pages, child.pages])
        child.parent = parent
        child.first_page = node.first_page
        parent.children[node.first_page] = child
        del self.lru_all[node]
        node.alive = False
        node.children = {}

    def _remove_leaf(self, node: Node) -> int:
        """Remove an unlocked leaf whole, then childless tombstones upward; returns pages freed."""
        freed = 0
        if self.evict_hook is not None and not node.spec:
            self.evict_hook(node)  # the leaf's KV path and state, before any id is freed
        while True:
            parent = node.parent
            del parent.children[node.first_page]
            self.pages.release_trusted(node.pages)
            freed += len(node.pages)
            del self.lru_all[node]
            if node.slot is not None:
                self._drop_state(node, demote=False)
            node.alive = False
            if parent.parent is None and not parent.children and parent.extra_key is not None:
                self.roots.pop(parent.extra_key, None)  # an emptied namespace goes away
            if parent.parent is None or parent.children:
                break
            if parent.slot is not None:
                if not parent.spec or parent.mamba_lock_ref:
                    break
                self._drop_state(parent)  # a speculative state holds no KV on its own
            node = parent
        self.counters["pages_evicted"] += freed
        return freed
