"""Insert into the Mamba radix tree (a mixin of ``MambaRadixCache``): ``insert`` and the edge
surgery it needs.

``insert(tokens, pages, snapshots)`` runs in numbered steps: (1) walk the tree to where the
sequence leaves it and classify the snapshot positions (accepted: page aligned, inside the whole
pages, not already holding a state); (2) take ownership of the ids: pages equal to the tree's are
the tree's own, other pages of the shared prefix are duplicates and are freed, pages past the
deepest kept state are freed, the rest adopted; rejected slots freed, accepted adopted; (3) find
or make the node ending at each accepted position: a chain of new nodes past the shared prefix,
splits of existing edges inside it; (4) store the states (most recent last in both LRU orders).
A state whose slot came from ``alloc_speculative_slots`` (``cache.spec_slots``) is stored as
speculative; a new branch hung below a node with a speculative state promotes that state. A chain
hung below a leaf's state (a next turn resuming from the previous end) demotes that state to
speculative: the deeper state supersedes it unless a hit or a divergence shows it pays.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mambacache.cache.node import InsertResult, Node, as_tokens, make_root, path_tokens

_EMPTY = np.zeros(0, dtype=np.int32)
_INT_TYPES = (int, np.integer)


class TreeInsert:
    """``insert`` for ``MambaRadixCache`` (uses its ``_walk``, allocators, orders, counters)."""

    def insert(self, token_ids, page_ids, snapshots: dict[int, int] | None = None,
               extra_key: Any = None, *, below: Node | None = None) -> InsertResult:
        """Cache ``token_ids`` (their KV in ``page_ids``) with state snapshots ``{pos: slot}``.

        ``page_ids``: ``int32[ceil(len(token_ids) / page_size)]``. Takes ownership of every page
        and slot passed; see ``InsertResult`` for what was kept.

        ``below`` (an extension): a live node on the sequence's path holding a state (the
        inserting request's locked node), or a root. ``token_ids`` / ``page_ids`` are then only
        the part past it (``tokens[below.depth:]``, ``pages[below.depth // page_size:]``) and the
        walk starts there; the pages above it must be the tree's own (the request read them from
        the tree). Snapshot positions stay absolute and must lie past ``below.depth``. The result
        is that of inserting the whole sequence from the root.
        """
        ps = self.page_size
        tokens, pages = as_tokens(token_ids), as_tokens(page_ids)  # 0. validate
        if len(pages) != -(-len(tokens) // ps):  # both 1-D (as_tokens)
            raise ValueError(f"insert: {len(tokens)} tokens need {-(-len(tokens) // ps)} pages of "
                             f"{ps}, got page_ids of shape {pages.shape}")
        snaps = snapshots or {}
        if below is None:
            start = self.roots.get(extra_key)
            if start is None:
                start = self.roots[extra_key] = make_root(extra_key)
            base = 0
        else:
            base = below.depth
            self._check_below(below, snaps)
            start = below
        whole = base + len(tokens) // ps * ps
        if (self._tuner is not None or self.split_tuner is not None) and extra_key is None:
            full = tokens if not base else np.concatenate([path_tokens(below), tokens])
            if self._tuner is not None:
                self._tuner.record_insert(full)
            if self.split_tuner is not None:  # [rebalance]
                self.split_tuner.record_insert(full)
        # 1. where the sequence leaves the tree; which snapshots are taken; how much is kept
        path, shared_end, partial, partial_len = self._walk(start, tokens, whole, base)
        accepted, rejected = self._classify(snaps, path, shared_end, whole)
        kept = accepted[-1] if accepted else base  # the deepest state on the path or accepted
        for node in path:
            if node.slot is not None and node.depth > kept:
                kept = node.depth
        # 2. ids: duplicate and surplus pages freed, new pages adopted, slots freed or adopted
        new_pages, num_freed = self._take_ids(pages, path, shared_end, partial, partial_len, kept,
                                              base)
        if rejected:
            self.free_slots([int(snaps[p]) for p in rejected])
        if accepted:
            self.slots.adopt([int(snaps[p]) for p in accepted])
        # 3. nodes ending at each accepted position and at ``kept``
        at = self._nodes_at(start, tokens, new_pages, path, shared_end, partial, partial_len,
                            accepted, kept, extra_key, base)
        # 4. the states go into their nodes (most recent last in both orders)
        spec_slots, lru_state, lru_all = self.spec_slots, self.lru_state, self.lru_all
        for pos in accepted:
            node = at[pos]
            node.slot = slot = int(snaps[pos])
            lru_state[node] = None
            lru_all.move_to_end(node)
            if spec_slots and slot in spec_slots:
                spec_slots.remove(slot)
                node.spec = True
                self.lru_spec[node] = None
        counters = self.counters
        counters["snapshots_kept"] += len(accepted)
        counters["snapshots_rejected"] += len(rejected)
        if start.parent is None and not start.children and extra_key is not None:
            del self.roots[extra_key]
        return InsertResult(kept, at[kept], tuple(accepted), tuple(rejected), len(new_pages),
                            num_freed)

    @staticmethod
    def _check_below(below: Node, snapshots: dict[int, int]) -> None:
        """``ValueError`` unless ``below`` can start an extension (``insert``'s ``below``)."""
        if not below.alive or (below.parent is not None and below.slot is None):
            raise ValueError(f"insert below {below!r}: it is "
                             f"{'evicted' if not below.alive else 'a tombstone'}")
        if snapshots and min(snapshots) <= below.depth:
            raise ValueError(f"insert below {below!r}: snapshot position {min(snapshots)} is "
                             f"not past its depth {below.depth}")

    def _nodes_at(self, root: Node, tokens: np.ndarray, new_pages: np.ndarray, path: list[Node],
                  shared_end: int, partial: Node | None, partial_len: int, accepted: list[int],
                  kept: int, extra_key: Any, base: int = 0) -> dict[int, Node]:
        """``{position: node ending there}`` for ``accepted + [kept]``: first a chain of new nodes
        past the shared prefix (splitting ``partial`` where the sequence leaves its edge), then
        the existing nodes on the path (splitting an edge where a position falls inside it).
        ``root``: where the walk started (a root, or ``insert``'s ``below`` at depth ``base``;
        ``tokens[0]`` is the token at position ``base``)."""
        at: dict[int, Node] = {}
        if kept > shared_end:
            parent = self._split(partial, partial_len) if partial is not None else (
                path[-1] if path else root)
            if parent.spec and parent.children:  # the new chain makes it a branch point
                self._promote(parent)
            elif parent.slot is not None and not parent.children and not parent.spec:
                self._demote(parent)  # a deeper state on the same path supersedes it
            ends = [p for p in accepted if p > shared_end]
            at.update(zip(ends, self._new_chain(parent, tokens, new_pages, shared_end, ends,
                                                 extra_key, base), strict=True))
        old = [p for p in accepted if p <= shared_end]
        if kept <= shared_end:
            old.append(kept)
        if old:
            start = self._deepest_above(root, path, old)
            at.update(zip(old, self._nodes_ending_at(start, tokens, old, base), strict=True))
        return at

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
                   ends: list[int], extra_key: Any, base: int = 0) -> list[Node]:
        """New nodes below ``parent`` for positions ``[begin, ends[-1])`` (``tokens`` start at
        position ``base``; KV ``pages``), one ending at each of the sorted ``ends``; returns
        them top down."""
        ps = self.page_size
        key = tokens[begin - base:ends[-1] - base].copy()
        lru_all = self.lru_all
        if len(ends) == 1:  # the usual chain: one node, the arrays whole (no views made)
            node = Node(key, pages, parent, ends[0], extra_key)
            self._link(parent, node)
            lru_all[node] = None
            return [node]
        raw = key.tobytes()  # first pages as bytes slices (cheaper than a view + tobytes each)
        out, pos = [], begin
        for end in ends:
            lo, hi = pos - begin, end - begin
            node = Node(key[lo:hi], pages[lo // ps:hi // ps], parent, end, extra_key)
            self._link(parent, node, raw[4 * lo:4 * (lo + ps)])
            lru_all[node] = None
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
                  partial: Node | None, partial_len: int, kept: int,
                  base: int = 0) -> tuple[np.ndarray, int]:
        """Free duplicate / surplus pages; adopt the new ones ``[shared_end, kept)`` (positions;
        ``pages[0]`` holds position ``base``, ``path`` starts below it).

        Returns ``(new_pages, num_freed)``.
        """
        ps = self.page_size
        n_base = base // ps
        n_shared = shared_end // ps - n_base
        nodes = path + [partial] if partial is not None else path
        to_free, offset = [], 0
        raw = pages.tobytes() if nodes else b""
        for node in nodes:  # pages equal to the tree's are the tree's own (a cache hit)
            tree = node.pages if node is not partial else node.pages[:partial_len // ps]
            if not raw.startswith(tree.tobytes(), 4 * offset):
                mine = pages[offset:offset + len(tree)]
                to_free.append(mine[mine != tree])
            offset += len(tree)
        surplus = max(shared_end, kept) // ps - n_base
        if surplus < len(pages):
            to_free.append(pages[surplus:])
        num_freed = sum(len(x) for x in to_free) if to_free else 0
        if num_freed:
            self.pages.free(np.concatenate(to_free) if len(to_free) > 1 else to_free[0])
        if kept <= shared_end:
            return _EMPTY, num_freed
        new = pages[n_shared:kept // ps - n_base].copy()
        self.pages.adopt(new)
        return new, num_freed

    def _nodes_ending_at(self, start: Node, tokens: np.ndarray, positions: list[int],
                         base: int = 0) -> list[Node]:
        """The nodes ending exactly at each of the sorted ``positions`` on the (existing) path of
        ``tokens`` (starting at position ``base``) below ``start`` (a node on that path, at most
        as deep as the first position), splitting edges as needed; a position equal to
        ``start.depth`` gives ``start``."""
        ps = self.page_size
        node, depth, out = start, start.depth, []
        for pos in positions:
            while depth < pos:
                child = node.children[tokens[depth - base:depth - base + ps].tobytes()]
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

    def _link(self, parent: Node, child: Node, first: bytes | None = None) -> None:
        """Make ``child`` the child of ``parent`` keyed by its first page (``first_page``;
        ``first``: those bytes when the caller has them already)."""
        if first is None:
            first = child.key[:self.page_size].tobytes()
        child.first_page = first
        parent.children[first] = child
