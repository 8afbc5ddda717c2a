"""``check_tree``: rebuild every count and both recency orders of a radix cache from the tree.

Raises ``AssertionError`` naming the node and the broken invariant. Invariants checked:

* structure: parent/child links agree, a child is keyed by its first page, keys are whole pages,
  ``len(pages) == len(key) // page_size``, ``depth == parent.depth + len(key)``, no empty edge;
* a leaf is never a tombstone; a state-locked node has a state; a speculative node has a state;
* ``full_lock_ref == mamba_lock_ref + sum(child.full_lock_ref)`` (so ``full >= mamba``);
* ``lru_all`` holds exactly the nodes, ``lru_state`` exactly the nodes with a state, ``lru_spec``
  exactly the nodes with a speculative state;
* the slots marked for speculative snapshots (``spec_slots``) are all held by requests;
* every page / slot in the tree appears once, and the tree's ids are exactly the allocator ids
  with status ``TREE`` (free and held ids are audited by ``IdAllocator.check``);
* the cached locked-page and locked-slot counters equal the recount.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mambacache.cache.allocator import HELD, TREE


def _fail(msg: str) -> None:
    raise AssertionError(msg)


def _check_node(node: Any, parent: Any, ps: int) -> None:
    if not node.alive:
        _fail(f"{node!r} is in the tree but marked evicted")
    if node.parent is not parent:
        _fail(f"{node!r}: parent link does not point to the node holding it")
    klen = len(node.key)
    if klen == 0 or klen % ps:
        _fail(f"{node!r}: edge of {klen} tokens is not a positive multiple of page_size {ps}")
    if len(node.pages) != klen // ps:
        _fail(f"{node!r}: {len(node.pages)} pages for {klen} tokens (page_size {ps})")
    if node.depth != parent.depth + klen:
        _fail(f"{node!r}: depth {node.depth} != parent depth {parent.depth} + {klen}")
    if node.first_page != node.key[:ps].tobytes():
        _fail(f"{node!r}: first_page is not the bytes of its key's first page")
    if parent.children.get(node.first_page) is not node:
        _fail(f"{node!r}: not keyed by its first page in its parent")
    if not node.children and node.slot is None:
        _fail(f"{node!r}: a leaf without a state (tombstone leaf)")
    if node.spec and node.slot is None:
        _fail(f"{node!r}: speculative without a state")
    if node.mamba_lock_ref < 0 or (node.mamba_lock_ref and node.slot is None):
        _fail(f"{node!r}: state lock {node.mamba_lock_ref} on a node without a valid state")
    want = node.mamba_lock_ref + sum(c.full_lock_ref for c in node.children.values())
    if node.full_lock_ref != want:
        _fail(f"{node!r}: full_lock_ref {node.full_lock_ref} != mamba_lock_ref "
              f"{node.mamba_lock_ref} + children's full locks = {want}")
    if node.extra_key != parent.extra_key:
        _fail(f"{node!r}: extra_key {node.extra_key!r} differs from its parent's")


def _walk_tree(cache: Any):
    """Yield every non-root node, checking structure on the way."""
    ps = cache.page_size
    for key, root in cache.roots.items():
        if root.parent is not None or len(root.key) or root.slot is not None:
            _fail(f"root for extra_key {key!r} is malformed: {root!r}")
        if root.extra_key != key or root.full_lock_ref or root.mamba_lock_ref:
            _fail(f"root for extra_key {key!r} has extra_key {root.extra_key!r} or locks")
        stack = [root]
        while stack:
            parent = stack.pop()
            for child in parent.children.values():
                _check_node(child, parent, ps)
                yield child
                stack.append(child)


def _same_ids(kind: str, in_tree: list, allocator: Any) -> None:
    ids = np.concatenate(in_tree).astype(np.int64) if in_tree else np.zeros(0, np.int64)
    uniq = np.unique(ids)
    if len(uniq) != len(ids):
        vals, counts = np.unique(ids, return_counts=True)
        _fail(f"{kind} owned twice by the tree: {vals[counts > 1].tolist()[:8]}")
    owned = np.flatnonzero(allocator._status == TREE)
    if not np.array_equal(uniq, owned):
        extra = np.setdiff1d(uniq, owned).tolist()[:8]
        missing = np.setdiff1d(owned, uniq).tolist()[:8]
        _fail(f"{kind}: in the tree but not TREE-owned in the allocator {extra}; "
              f"TREE-owned but not in the tree {missing}")


def check_tree(cache: Any) -> None:
    nodes, page_parts, slot_ids = [], [], []
    locked_pages = locked_slots = 0
    for node in _walk_tree(cache):
        nodes.append(node)
        page_parts.append(node.pages)
        if node.slot is not None:
            slot_ids.append(node.slot)
            locked_slots += node.mamba_lock_ref > 0
        if node.full_lock_ref > 0:
            locked_pages += len(node.pages)
    node_set = set(nodes)
    if len(cache.lru_all) != len(nodes) or set(cache.lru_all) != node_set:
        _fail(f"lru_all holds {len(cache.lru_all)} nodes, the tree {len(nodes)}; "
              f"they differ by {len(set(cache.lru_all) ^ node_set)} nodes")
    stateful = {n for n in nodes if n.slot is not None}
    if len(cache.lru_state) != len(stateful) or set(cache.lru_state) != stateful:
        _fail(f"lru_state holds {len(cache.lru_state)} nodes, the tree has {len(stateful)} "
              f"nodes with a state")
    speculative = {n for n in stateful if n.spec}
    if len(cache.lru_spec) != len(speculative) or set(cache.lru_spec) != speculative:
        _fail(f"lru_spec holds {len(cache.lru_spec)} nodes, the tree has {len(speculative)} "
              f"nodes with a speculative state")
    marked = np.array(sorted(cache.spec_slots), np.int64)
    if len(marked) and not (cache.slots._status[marked] == HELD).all():
        _fail(f"slots marked speculative but not held by a request: "
              f"{marked[cache.slots._status[marked] != HELD].tolist()[:8]}")
    _same_ids("KV pages", page_parts, cache.pages)
    _same_ids("state slots", [np.array(slot_ids, np.int64)], cache.slots)
    if cache.locked_pages() != locked_pages:
        _fail(f"locked pages counter {cache.locked_pages()} != recount {locked_pages}")
    spec_locked = sum(1 for n in speculative if n.mamba_lock_ref > 0)
    if cache._locked_spec != spec_locked:
        _fail(f"locked speculative counter {cache._locked_spec} != recount {spec_locked}")
    if cache.locked_slots() != locked_slots:
        _fail(f"locked slots counter {cache.locked_slots()} != recount {locked_slots}")
