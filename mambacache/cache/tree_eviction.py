"""``TreeEviction``: the cache side of eviction, a mixin of ``MambaRadixCache``. The policies
(``eviction.py``) only choose; this removes what they name and keeps the tree's invariants.

``evict_pages(n)`` / ``evict_slots(n)`` loop over the policy's candidates until ``n`` are free or
nothing is evictable. A state dropped from a node with one child folds the node into that child
(no chains of tombstones).

Speculative states (``Node.spec``) come before any policy: ``evict_slots`` first drops unlocked
speculative states, least recently used first (``cache.lru_spec``), and only then asks the
policy; KV eviction treats an unlocked speculative state like a tombstone (removing a leaf goes on
upward through it), so a speculative state never keeps KV that the tree without it would free.

Every state dropped by eviction, speculative or firm, goes to ``evict_hook`` first (the host
tier's ``demote``: it keeps a copy when it has room, ``cache/host_tier.py``); ``evict_above``
(ids a shrinking pool loses) does not demote.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from mambacache.cache.node import unlocked_states

if TYPE_CHECKING:
    from mambacache.cache.node import Node


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
        when the node is): the ids a shrinking device pool loses (``engine/runners/rebalance.py``).
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
        for node in unlocked_states(self.lru_spec, num):
            if not node.spec:  # dropped already, as the parent of an earlier victim
                continue
            if node.children:
                self._drop_state(node)
            else:
                self._remove_leaf(node)
        return self.slots.num_free - before

    def _drop_state(self, node: Node, demote: bool = True) -> None:
        if demote and self.evict_hook is not None:
            self.evict_hook(node)  # an internal state: the host tier may keep a copy
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
        if self.evict_hook is not None:
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
