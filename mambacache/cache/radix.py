"""``MambaRadixCache``: a radix tree over token ids holding KV page ids and state snapshots.

API (the engine calls exactly this; ids are numpy ``int32``, never ``jax.Array``)::

    cache = make_cache(enable=True, num_pages=..., num_slots=..., page_size=1, eviction="lru")
    m = cache.match_prefix(prompt_ids, extra_key=None)  # MatchResult (node.py)
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
* ``insert`` (``insert.py``) takes ownership of every page and slot passed: KV already in
  the tree is freed (unless it is the tree's own page), KV past the deepest state of the sequence
  and the partial last page are freed, rejected snapshots are freed. Accepted snapshots heal
  tombstones or split edges. The tree keeps only whole pages; a leaf always ends in a state.
* Eviction (``evict_pages`` / ``evict_slots``, ``tree_eviction.py``) follows the policy
  (``eviction.py``): KV eviction removes unlocked leaves whole (state included) and then
  childless tombstones upward; state eviction turns an internal node into a tombstone and
  removes a leaf whole.
* Speculative states (``Node.spec``): the ``prompt_len - 1`` snapshot and periodic checkpoints
  get their slots from ``alloc_speculative_slots`` (free slots, or slots of other speculative
  states: never by evicting a firm state, unless a host tier with room keeps what the device
  evicts), which marks the slots; ``insert`` turns a marked slot
  into a speculative state. They are evicted first (``eviction.py``) until a hit (``match_prefix``
  returns the node) or a divergence (a second child) promotes them. ``lru_spec`` orders them.
* ``extra_key`` namespaces the tree: each key has its own root.
* Ids held by requests are tracked by the allocators (``HELD``), so ``check_integrity()`` needs no
  arguments: tree + free lists + held ids must cover every id exactly once.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np

from mambacache.cache.base import CACHE_CLASSES, CacheBase, register_cache
from mambacache.cache.budget import ByteBudget
from mambacache.cache.eviction import make_policy
from mambacache.cache.insert import TreeInsert
from mambacache.cache.integrity import check_tree
from mambacache.cache.node import MatchResult, Node, as_tokens, make_root
from mambacache.cache.tree_eviction import TreeEviction

_EMPTY = np.zeros(0, dtype=np.int32)
#: ``eviction = "auto"`` with a byte budget: the alpha tuner every 256 admissions on the last 128
#: requests (the same replays per request as 512 / 256; a late switch of alpha costs more than
#: it gains: on ShareGPT chat at 1 conv/s, 1-2 GiB, 0.035 / 0.063 against 0.028 / 0.047); a
#: candidate wins by more than 0.5 % of the hits (shadows replayed with the requests in flight
#: rank close alphas well enough: agents 8 at a time, 5 GiB, 0.840 -> 0.842, docs/bench.md)
AUTO_TUNE_EVERY, AUTO_TUNE_WINDOW, AUTO_TUNE_MARGIN = 256, 128, 0.005


@register_cache(True)
class MambaRadixCache(TreeInsert, TreeEviction, CacheBase):
    """Radix tree of KV pages and state snapshots; see the module docstring."""

    def __init__(self, num_pages: int, num_slots: int, page_size: int = 1,
                 eviction: str = "lru", speculative_states: bool = True,
                 budget: ByteBudget | None = None, **policy_kwargs: Any):
        super().__init__(num_pages, num_slots, page_size, budget)
        if not isinstance(speculative_states, bool):
            raise ValueError(f"speculative_states must be a bool, got {speculative_states!r}")
        self.speculative_states = speculative_states
        if budget is not None and eviction == "flop_aware":  # a state's size in KV tokens
            policy_kwargs.setdefault("state_bytes_in_tokens",
                                     budget.slot_bytes * page_size / budget.page_bytes)
        self.policy = make_policy(eviction, **policy_kwargs)
        self._tuner = getattr(self.policy, "tuner", None)  # flop_aware alpha="auto" only
        self.roots: dict[Any, Node] = {None: make_root()}
        self.lru_all: OrderedDict[Node, None] = OrderedDict()  # every node, oldest first
        self.lru_state: OrderedDict[Node, None] = OrderedDict()  # nodes with a state
        self.lru_spec: OrderedDict[Node, None] = OrderedDict()  # nodes with a speculative state
        self.spec_slots: set[int] = set()  # HELD slots that insert makes speculative states
        self._locked_pages = 0  # pages of nodes with full_lock_ref > 0
        self._locked_slots = 0  # slots of nodes with mamba_lock_ref > 0
        self._locked_spec = 0  # of those, speculative ones
        # called with a node whose state (and the KV of its path) eviction is about to
        # drop, before any id is freed: the host tier's demotion (``cache/host_tier.py``)
        self.evict_hook: Callable[[Node], None] | None = None

    # --------------------------------------------------------------------------- counts
    def evictable_pages(self) -> int:
        return self.pages.num_tree - self._locked_pages

    def evictable_slots(self) -> int:
        return self.slots.num_tree - self._locked_slots

    def locked_pages(self) -> int:
        return self._locked_pages

    def locked_slots(self) -> int:
        return self._locked_slots

    def usage(self) -> tuple[float, float]:
        return (self.pages.share_protected(self._locked_pages),
                self.slots.share_protected(self._locked_slots))

    def stats(self) -> dict[str, Any]:
        out = super().stats()
        out["tree_nodes"] = len(self.lru_all)
        out["tree_states"] = len(self.lru_state)
        out["tree_speculative_states"] = len(self.lru_spec)
        if self.host_tier is not None:
            out.update(self.host_tier.stats())
        return out

    def check_integrity(self) -> None:
        """Rebuild every count and both orders from the tree and compare (``AssertionError``)."""
        check_tree(self)
        self._check_accounting()
        if self.host_tier is not None:
            self.host_tier.check()

    # --------------------------------------------------------------------------- walking
    def _walk(self, root: Node, tokens: np.ndarray, limit: int, base: int = 0):
        """Follow the tokens up to position ``limit`` (a page multiple) down from ``root``, a
        node at depth ``base`` (``tokens[0]`` is the token at position ``base``).

        Returns ``(path, shared_end, partial, partial_len)``: the nodes below ``root`` matched
        whole, the position up to which the tokens are in the tree (page multiple), and the
        child whose edge the tokens leave after ``partial_len`` tokens (``None`` if they leave
        at a node boundary).
        """
        ps = self.page_size
        raw = tokens.tobytes()  # bytes slices are ~5x cheaper than numpy slices + tobytes
        node, pos, path = root, base, []
        while pos < limit:
            at = 4 * (pos - base)
            child = node.children.get(raw[at:at + 4 * ps])
            if child is None:
                break
            klen = len(child.key)
            n = min(klen, limit - pos)
            key = child.key.tobytes() if n == klen else child.key[:n].tobytes()
            if raw.startswith(key, at):
                same = n
            else:
                diff = child.key[:n] != tokens[pos - base:pos - base + n]
                same = int(np.flatnonzero(diff)[0]) // ps * ps
            if same < klen:
                return path, pos + same, child, same
            path.append(child)
            node, pos = child, pos + klen
        return path, pos, None, 0

    # --------------------------------------------------------------------------- speculative
    def evictable_speculative_slots(self) -> int:
        return len(self.lru_spec) - self._locked_spec

    def alloc_speculative_slots(self, num: int, evict: int | None = None) -> np.ndarray:
        """``int32[k]``, ``k <= num``: slots for speculative snapshots, from the free list and
        from evicting at most ``evict`` (default ``num``) unlocked speculative states, oldest
        first; never a firm state. The slots are marked: ``insert`` keeps them as speculative
        states.

        Slack rule: a held speculative slot cannot be evicted while its request runs, so after
        the grant the free + evictable speculative slots must still be at least the slots held
        by requests before it (a proxy for what the next admissions need): fewer or none are
        granted otherwise, and the next running slot never pushes out a firm state for them.
        """
        slot_bytes = self.budget.slot_bytes if self.budget is not None else 1
        free = self._room(self.slots, slot_bytes)
        spec = self.evictable_speculative_slots()
        num = min(num, free + spec - self.slots.num_held)
        if num <= 0:
            return self._slot_through_the_tier() if evict else _EMPTY
        short = min(num - free, num if evict is None else evict)
        if short > 0:
            self._evict_speculative(short)
        got = self.slots.alloc(min(num, self._room(self.slots, slot_bytes)))
        if len(got):
            self.spec_slots.update(got.tolist())
            if self.budget is not None:
                self._note_peak()
        return got

    def _slot_through_the_tier(self) -> np.ndarray:
        """One slot for the ``prompt_len - 1`` snapshot from evicting any unlocked state (by the
        policy) when a host tier with room keeps what the device evicts (it is demoted, not
        lost), under the same slack rule over every evictable state; else none."""
        tier = self.host_tier
        if tier is None or not tier.has_room(self.page_size) or \
                self.evictable_slots() + self.slots.num_free - self.slots.num_held < 1:
            return _EMPTY
        got = self.alloc_slots(1)
        if got is None:
            return _EMPTY
        self.spec_slots.update(got.tolist())
        return got

    def free_slots(self, ids) -> None:
        if self.spec_slots:
            self.spec_slots.difference_update(ids.tolist() if isinstance(ids, np.ndarray) else ids)
        self.slots.free(ids)

    def _promote(self, node: Node) -> None:
        """A hit or a divergence showed that ``node``'s speculative state pays: keep it as firm."""
        node.spec = False
        del self.lru_spec[node]
        self._locked_spec -= node.mamba_lock_ref > 0
        self.counters["snapshots_promoted"] += 1

    def _demote(self, node: Node) -> None:
        """A deeper state now extends ``node``'s path with no branch: its state becomes a bet
        (evicted first), until a hit or a divergence promotes it again."""
        node.spec = True
        self.lru_spec[node] = None
        self._locked_spec += node.mamba_lock_ref > 0
        self.counters["snapshots_demoted"] += 1

    def _touch(self, node: Node) -> None:
        self.lru_all.move_to_end(node)
        if node.slot is not None:
            self.lru_state.move_to_end(node)

    # --------------------------------------------------------------------------- match
    def match_prefix(self, prompt_ids, extra_key: Any = None) -> MatchResult:
        """Longest cached prefix of ``prompt_ids`` that has a state; see ``MatchResult``."""
        tokens = as_tokens(prompt_ids)
        if self._tuner is not None and extra_key is None and self._tuner.record_match(tokens):
            self.policy.set_alpha(self._tuner.tune(self))
        if self.split_tuner is not None and extra_key is None:  # [rebalance]
            self.split_tuner.record_match(tokens)
        root = self.roots.get(extra_key)
        if root is None or len(tokens) == 0:
            return MatchResult(0, _EMPTY, None, root or self.roots[None], 0)
        limit = len(tokens) // self.page_size * self.page_size
        path, shared_end, _, _ = self._walk(root, tokens, limit)
        cap = len(tokens) - 1
        for i in range(len(path) - 1, -1, -1):
            node = path[i]
            if node.slot is not None and node.depth <= cap:
                if node.spec:
                    self._promote(node)
                self._touch(node)
                pages = path[0].pages if i == 0 else np.concatenate([n.pages for n in path[:i + 1]])
                return MatchResult(node.depth, pages, node.slot, node, shared_end)
        return MatchResult(0, _EMPTY, None, root, shared_end)

    def peek(self, prompt_ids, extra_key: Any = None) -> int:
        """The ``cached_len`` that ``match_prefix`` would return, with no side effect (no
        refresh, no promotion, no tuner record)."""
        tokens = as_tokens(prompt_ids)
        root = self.roots.get(extra_key)
        if root is None or len(tokens) == 0:
            return 0
        path, _, _, _ = self._walk(root, tokens, len(tokens) // self.page_size * self.page_size)
        for node in reversed(path):
            if node.slot is not None and node.depth <= len(tokens) - 1:
                return node.depth
        return 0

    def locate(self, token_ids, extra_key: Any = None) -> tuple[int, np.ndarray, Node | None]:
        """``(shared_len, page_ids, end)``: how many tokens of ``token_ids`` (a page multiple)
        have their KV in the tree, the tree's pages of them, and the node ending exactly at
        ``len(token_ids)`` (``None`` if none). Read-only."""
        tokens = as_tokens(token_ids)
        root = self.roots.get(extra_key)
        if root is None:
            return 0, _EMPTY, None
        limit = len(tokens) // self.page_size * self.page_size
        path, shared, partial, partial_len = self._walk(root, tokens, limit)
        parts = [n.pages for n in path]
        if partial is not None:
            parts.append(partial.pages[:partial_len // self.page_size])
        pages = np.concatenate(parts) if parts else _EMPTY
        end = path[-1] if path and partial is None and path[-1].depth == len(tokens) else None
        return shared, pages, end

    # --------------------------------------------------------------------------- locks
    def lock(self, node: Node) -> None:
        """Protect ``node``'s state and the KV of its path to the root until ``unlock``."""
        if node.parent is None:
            return
        if not node.alive or node.slot is None:
            raise ValueError(f"lock: {node!r} is {'evicted' if not node.alive else 'a tombstone'}")
        if node.mamba_lock_ref == 0:
            self._locked_slots += 1
            self._locked_spec += node.spec
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
            self._locked_spec -= node.spec
        while node.parent is not None:
            node.full_lock_ref -= 1
            if node.full_lock_ref == 0:
                self._locked_pages -= len(node.pages)
            node = node.parent



def make_cache(enable: bool = True, num_pages: int = 1, num_slots: int = 1, page_size: int = 1,
               eviction: str = "lru", speculative_states: bool = True,
               budget: ByteBudget | None = None, **policy_kwargs: Any) -> CacheBase:
    """Build the cache registered for ``enable`` (``True``: radix, ``False``: disabled).

    ``speculative_states``: plan the ``prompt_len - 1`` snapshot and checkpoints (kept as
    speculative states); False keeps states only at branch points and request ends.
    ``budget``: one byte budget for both pools (``cache/budget.py``); ``None``: two fixed pools.
    ``eviction="auto"``: ``lru`` for fixed pools, tuned ``flop_aware`` with a budget.
    """
    import mambacache.cache.disabled  # noqa: F401  (registers the disabled cache)

    if enable not in CACHE_CLASSES:
        raise ValueError(f"no cache registered for enable={enable!r}; have {list(CACHE_CLASSES)}")
    if eviction == "auto":  # one byte budget: rank KV and states by FLOPs saved per byte
        eviction = "flop_aware" if budget is not None else "lru"
        if budget is not None:  # tune early and on short windows (docs/bench.md 2026-12-02)
            policy_kwargs.setdefault("tune_every", AUTO_TUNE_EVERY)
            policy_kwargs.setdefault("tune_window", AUTO_TUNE_WINDOW)
            policy_kwargs.setdefault("tune_margin", AUTO_TUNE_MARGIN)
    return CACHE_CLASSES[enable](num_pages, num_slots, page_size, eviction,
                                 speculative_states=speculative_states, budget=budget,
                                 **policy_kwargs)
