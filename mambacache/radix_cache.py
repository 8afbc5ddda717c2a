"""``MambaRadixCache``: a radix tree over token ids holding KV page ids and state snapshots.

API (the engine calls exactly this; ids are numpy ``int32``, never ``jax.Array``)::

    cache = make_cache(enable=True, num_pages=..., num_slots=..., page_size=1, eviction="lru")
    m = cache.match_prefix(prompt_ids, extra_key=None)  # MatchResult (radix_node.py)
    cache.lock(m.node)             # full lock on the path to the root + state lock on m.node
    slots = cache.alloc_slots(n)   # evicts per the policy; None when impossible (never raises)
    pages = cache.alloc_pages(n)
    res = cache.insert(token_ids, page_ids, snapshots={pos: slot}, extra_key=None)  # InsertResult
    cache.unlock(m.node)
    cache.stats(); cache.check_integrity()

Semantics (and the fixes versus SGLang's ``MambaRadixCache``):

* ``match_prefix`` is read-only except for refreshing the ONE node whose state it returns (no
  path refresh, no split). It walks the whole prompt (page by page), so an identical prompt hits
  up to the deepest state at or before ``len(prompt) - 1``: identical prompts hit.
* ``insert`` takes ownership of every page and slot passed: KV already in the tree is freed
  (unless it is the tree's own page), KV past the deepest state of the sequence and the partial
  last page are freed, rejected snapshots are freed. Accepted snapshots heal tombstones or split
  edges. The tree keeps only whole pages; a leaf always ends in a state.
* Eviction (``evict_pages`` / ``evict_slots``) follows the policy (``eviction.py``): KV eviction
  removes unlocked leaves whole (state included) and then childless tombstones upward; state
  eviction turns an internal node into a tombstone and removes a leaf whole.
* ``extra_key`` namespaces the tree: each key has its own root.
* Ids held by requests are tracked by the allocators (``HELD``), so ``check_integrity()`` needs no
  arguments: tree + free lists + held ids must cover every id exactly once.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np

from mambacache.cache_base import CACHE_CLASSES, CacheBase, register_cache
from mambacache.eviction import TreeEviction, make_policy
from mambacache.radix_integrity import check_tree
from mambacache.radix_node import InsertResult, MatchResult, Node, make_root

_EMPTY = np.zeros(0, dtype=np.int32)
_INT_TYPES = (int, np.integer)
_INT32 = np.dtype(np.int32)  # compared by identity (cheaper than dtype ==)


def _as_tokens(ids) -> np.ndarray:
    if type(ids) is np.ndarray and ids.dtype is _INT32 and ids.ndim == 1:
        return ids
    arr = np.asarray(ids, dtype=np.int32)
    if arr.ndim != 1:
        raise ValueError(f"token ids must be 1-D, got shape {arr.shape}")
    return arr


@register_cache(True)
class MambaRadixCache(TreeEviction, CacheBase):
    """Radix tree of KV pages and state snapshots; see the module docstring."""

    def __init__(self, num_pages: int, num_slots: int, page_size: int = 1,
                 eviction: str = "lru", **policy_kwargs: Any):
        super().__init__(num_pages, num_slots, page_size)
        self.policy = make_policy(eviction, **policy_kwargs)
        self.roots: dict[Any, Node] = {None: make_root()}
        self.lru_all: OrderedDict[Node, None] = OrderedDict()  # every node, oldest first
        self.lru_state: OrderedDict[Node, None] = OrderedDict()  # nodes with a state
        self._locked_pages = 0  # pages of nodes with full_lock_ref > 0
        self._locked_slots = 0  # slots of nodes with mamba_lock_ref > 0

    # --------------------------------------------------------------------------- counts
    def evictable_pages(self) -> int:
        return self.pages.num_tree - self._locked_pages

    def evictable_slots(self) -> int:
        return self.slots.num_tree - self._locked_slots

    def locked_pages(self) -> int:
        return self._locked_pages

    def locked_slots(self) -> int:
        return self._locked_slots

    def stats(self) -> dict[str, Any]:
        out = super().stats()
        out["tree_nodes"] = len(self.lru_all)
        out["tree_states"] = len(self.lru_state)
        return out

    def check_integrity(self) -> None:
        """Rebuild every count and both orders from the tree and compare (``AssertionError``)."""
        check_tree(self)
        self._check_accounting()

    # --------------------------------------------------------------------------- walking
    def _walk(self, root: Node, tokens: np.ndarray, limit: int):
        """Follow ``tokens[:limit]`` (``limit`` a page multiple) down from ``root``.

        Returns ``(path, shared_end, partial, partial_len)``: the nodes matched whole, the number
        of tokens found in the tree (page multiple), and the child whose edge the tokens leave
        after ``partial_len`` tokens (``None`` if they leave at a node boundary).
        """
        ps = self.page_size
        raw = tokens.tobytes()  # bytes slices are ~5x cheaper than numpy slices + tobytes
        node, pos, path = root, 0, []
        while pos < limit:
            child = node.children.get(raw[4 * pos:4 * (pos + ps)])
            if child is None:
                break
            klen = len(child.key)
            n = min(klen, limit - pos)
            key = child.key.tobytes() if n == klen else child.key[:n].tobytes()
            if raw.startswith(key, 4 * pos):
                same = n
            else:
                diff = child.key[:n] != tokens[pos:pos + n]
                same = int(np.flatnonzero(diff)[0]) // ps * ps
            if same < klen:
                return path, pos + same, child, same
            path.append(child)
            node, pos = child, pos + klen
        return path, pos, None, 0

    def _nodes_ending_at(self, start: Node, tokens: np.ndarray, positions: list[int]) -> list[Node]:
        """The nodes ending exactly at each of the sorted ``positions`` on the (existing) path of
        ``tokens`` below ``start`` (a node on that path, at most as deep as the first position),
        splitting edges as needed; a position equal to ``start.depth`` gives ``start``."""
        ps = self.page_size
        node, depth, out = start, start.depth, []
        for pos in positions:
            while depth < pos:
                child = node.children[tokens[depth:depth + ps].tobytes()]
                end = depth + len(child.key)
                if end > pos:
                    child, end = self._split(child, pos - depth), pos
                node, depth = child, end
            out.append(node)
        return out

    def _split(self, child: Node, offset: int) -> Node:
        """Cut ``child``'s edge after ``offset`` tokens; returns the new upper node (tombstone).

        ``child`` keeps its identity, state and locks (a locked node stays valid); the upper node
        inherits ``child.full_lock_ref`` since every lock below it passes through it.
        """
        ps = self.page_size
        parent = child.parent
        upper = Node(child.key[:offset], child.pages[:offset // ps], parent,
                     child.depth - len(child.key) + offset, child.extra_key)
        upper.full_lock_ref = child.full_lock_ref
        child.key = child.key[offset:]
        child.pages = child.pages[offset // ps:]
        child.parent = upper
        self._link(parent, upper)
        self._link(upper, child)
        self.lru_all[upper] = None
        return upper

    def _link(self, parent: Node, child: Node) -> None:
        """Make ``child`` the child of ``parent`` keyed by its first page (``first_page``)."""
        child.first_page = key = child.key[:self.page_size].tobytes()
        parent.children[key] = child

    def _touch(self, node: Node) -> None:
        self.lru_all.move_to_end(node)
        if node.slot is not None:
            self.lru_state.move_to_end(node)

    # --------------------------------------------------------------------------- match
    def match_prefix(self, prompt_ids, extra_key: Any = None) -> MatchResult:
        """Longest cached prefix of ``prompt_ids`` that has a state; see ``MatchResult``."""
        tokens = _as_tokens(prompt_ids)
        root = self.roots.get(extra_key)
        if root is None or len(tokens) == 0:
            return MatchResult(0, _EMPTY, None, root or self.roots[None], 0)
        limit = len(tokens) // self.page_size * self.page_size
        path, shared_end, _, _ = self._walk(root, tokens, limit)
        cap = len(tokens) - 1
        for i in range(len(path) - 1, -1, -1):
            node = path[i]
            if node.slot is not None and node.depth <= cap:
                self._touch(node)
                pages = path[0].pages if i == 0 else np.concatenate([n.pages for n in path[:i + 1]])
                return MatchResult(node.depth, pages, node.slot, node, shared_end)
        return MatchResult(0, _EMPTY, None, root, shared_end)

    # --------------------------------------------------------------------------- locks
    def lock(self, node: Node) -> None:
        """Protect ``node``'s state and the KV of its path to the root until ``unlock``."""
        if node.parent is None:
            return
        if not node.alive or node.slot is None:
            raise ValueError(f"lock: {node!r} is {'evicted' if not node.alive else 'a tombstone'}")
        if node.mamba_lock_ref == 0:
            self._locked_slots += 1
        node.mamba_lock_ref += 1
        while node.parent is not None:
            if node.full_lock_ref == 0:
                self._locked_pages += len(node.pages)
            node.full_lock_ref += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        if node.parent is None:
            return
        if not node.alive or node.mamba_lock_ref <= 0:
            raise ValueError(f"unlock: {node!r} is not locked")
        node.mamba_lock_ref -= 1
        if node.mamba_lock_ref == 0:
            self._locked_slots -= 1
        while node.parent is not None:
            node.full_lock_ref -= 1
            if node.full_lock_ref == 0:
                self._locked_pages -= len(node.pages)
            node = node.parent

    # --------------------------------------------------------------------------- insert
    def insert(self, token_ids, page_ids, snapshots: dict[int, int] | None = None,
               extra_key: Any = None) -> InsertResult:
        """Cache ``token_ids`` (their KV in ``page_ids``) with state snapshots ``{pos: slot}``.

        ``page_ids``: ``int32[ceil(len(token_ids) / page_size)]``. Takes ownership of every page
        and slot passed; see ``InsertResult`` for what was kept.
        """
        ps = self.page_size
        tokens, pages = _as_tokens(token_ids), _as_tokens(page_ids)  # 0. validate
        whole = len(tokens) // ps * ps
        if pages.shape != (-(-len(tokens) // ps),):
            raise ValueError(f"insert: {len(tokens)} tokens need {-(-len(tokens) // ps)} pages of "
                             f"{ps}, got page_ids of shape {pages.shape}")
        root = self.roots.get(extra_key)
        if root is None:
            root = self.roots[extra_key] = make_root(extra_key)
        # 1. where the sequence leaves the tree; which snapshots are taken; how much is kept
        path, shared_end, partial, partial_len = self._walk(root, tokens, whole)
        snaps = snapshots or {}
        accepted, rejected = self._classify(snaps, path, shared_end, whole)
        kept = max([n.depth for n in path if n.slot is not None] + accepted + [0])
        # 2. ids: duplicate and surplus pages freed, new pages adopted, slots freed or adopted
        new_pages, num_freed = self._take_ids(pages, path, shared_end, partial, partial_len, kept)
        if rejected:
            self.slots.free([int(snaps[p]) for p in rejected])
        if accepted:
            self.slots.adopt([int(snaps[p]) for p in accepted])
        # 3. nodes ending at each accepted position and at ``kept``: a chain of new ones past the
        #    shared prefix, then existing ones (split where a position falls inside an edge)
        at: dict[int, Node] = {}
        if kept > shared_end:
            parent = self._split(partial, partial_len) if partial is not None else (
                path[-1] if path else root)
            ends = [p for p in accepted if p > shared_end]
            at.update(zip(ends, self._new_chain(parent, tokens, new_pages, shared_end, ends,
                                                 extra_key), strict=True))
        old = [p for p in accepted if p <= shared_end]
        if kept <= shared_end:
            old.append(kept)
        if old:
            start = self._deepest_above(root, path, old)
            at.update(zip(old, self._nodes_ending_at(start, tokens, old), strict=True))
        # 4. the states go into their nodes (most recent last in both orders)
        for pos in accepted:
            node = at[pos]
            node.slot = int(snaps[pos])
            self.lru_state[node] = None
            self.lru_all.move_to_end(node)
        self.counters["snapshots_kept"] += len(accepted)
        self.counters["snapshots_rejected"] += len(rejected)
        if not root.children and extra_key is not None:
            del self.roots[extra_key]
        return InsertResult(kept, at[kept], tuple(accepted), tuple(rejected), len(new_pages),
                            num_freed)

    @staticmethod
    def _deepest_above(root: Node, path: list[Node], positions: list[int]) -> Node:
        """The deepest node of ``path`` (or the root) ending at or above ``positions[0]``."""
        start = root
        for node in path:
            if node.depth > positions[0]:
                break
            start = node
        return start

    def _new_chain(self, parent: Node, tokens: np.ndarray, pages: np.ndarray, begin: int,
                   ends: list[int], extra_key: Any) -> list[Node]:
        """New nodes below ``parent`` for ``tokens[begin:ends[-1]]`` (KV ``pages``), one ending at
        each of the sorted ``ends``; returns them top down."""
        ps = self.page_size
        key = tokens[begin:ends[-1]].copy()
        out, pos = [], begin
        for end in ends:
            lo, hi = pos - begin, end - begin
            node = Node(key[lo:hi], pages[lo // ps:hi // ps], parent, end, extra_key)
            self._link(parent, node)
            self.lru_all[node] = None
            out.append(node)
            parent, pos = node, end
        return out

    def _classify(self, snapshots: dict[int, int], path: list[Node], shared_end: int,
                  whole: int) -> tuple[list[int], list[int]]:
        """Split snapshot positions into accepted and rejected (both sorted)."""
        ps = self.page_size
        by_depth = None
        accepted, rejected = [], []
        for pos in sorted(snapshots):
            ok = isinstance(pos, _INT_TYPES) and pos % ps == 0 and 0 < pos <= whole
            if ok and pos <= shared_end:
                if by_depth is None:
                    by_depth = {n.depth: n for n in path}
                node = by_depth.get(pos)
                ok = node is None or node.slot is None
            (accepted if ok else rejected).append(int(pos))
        return accepted, rejected

    def _take_ids(self, pages: np.ndarray, path: list[Node], shared_end: int,
                  partial: Node | None, partial_len: int, kept: int) -> tuple[np.ndarray, int]:
        """Free duplicate / surplus pages; adopt the new ones ``[shared_end, kept)``.

        Returns ``(new_pages, num_freed)``.
        """
        ps = self.page_size
        n_shared = shared_end // ps
        nodes = path + [partial] if partial is not None else path
        to_free, offset = [], 0
        raw = pages.tobytes()
        for node in nodes:  # pages equal to the tree's are the tree's own (a cache hit)
            tree = node.pages if node is not partial else node.pages[:partial_len // ps]
            if not raw.startswith(tree.tobytes(), 4 * offset):
                mine = pages[offset:offset + len(tree)]
                to_free.append(mine[mine != tree])
            offset += len(tree)
        surplus = max(shared_end, kept) // ps
        if surplus < len(pages):
            to_free.append(pages[surplus:])
        num_freed = sum(len(x) for x in to_free)
        if num_freed:
            self.pages.free(np.concatenate(to_free) if len(to_free) > 1 else to_free[0])
        if kept <= shared_end:
            return _EMPTY, num_freed
        new = pages[n_shared:kept // ps].copy()
        self.pages.adopt(new)
        return new, num_freed


def make_cache(enable: bool = True, num_pages: int = 1, num_slots: int = 1, page_size: int = 1,
               eviction: str = "lru", **policy_kwargs: Any) -> CacheBase:
    """Build the cache registered for ``enable`` (``True``: radix, ``False``: disabled)."""
    import mambacache.disabled_cache  # noqa: F401  (registers the disabled cache)

    if enable not in CACHE_CLASSES:
        raise ValueError(f"no cache registered for enable={enable!r}; have {list(CACHE_CLASSES)}")
    return CACHE_CLASSES[enable](num_pages, num_slots, page_size, eviction, **policy_kwargs)


def make_cache_from_config(cache_cfg: Any, **policy_kwargs: Any) -> CacheBase:
    """``make_cache`` from a ``mambacache.config.CacheConfig``."""
    return make_cache(cache_cfg.enable, cache_cfg.num_pages, cache_cfg.num_mamba_slots,
                      cache_cfg.page_size, cache_cfg.eviction, **policy_kwargs)
