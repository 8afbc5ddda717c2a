"""A node of the Mamba radix tree and the result types of the cache API.

A node owns the edge from its parent: ``key`` (token ids, a whole number of pages) and ``pages``
(the KV page ids of those tokens). ``slot`` is the state slot holding the recurrent state after
the last token of ``key`` (i.e. after ``depth`` tokens from the root), or ``None``: a tombstone.
A leaf is never a tombstone.

``spec``: the state is speculative (the ``prompt_len - 1`` snapshot or a periodic checkpoint
that no request has hit yet and that is not a branch point): it is evicted before any other
state, and a hit or a second child promotes it (``spec = False``). Only a node with a state is
speculative.

Locks: ``full_lock_ref`` counts the locks at or below this node (it protects the KV of the path
to the root), ``mamba_lock_ref`` the locks on this node itself (it protects ``slot``). Hence
``full_lock_ref == mamba_lock_ref + sum(child.full_lock_ref)``, so ``full >= mamba``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import numpy as np

_EMPTY = np.zeros(0, dtype=np.int32)
_INT32 = np.dtype(np.int32)  # compared by identity (cheaper than dtype ==)


def as_tokens(ids) -> np.ndarray:
    """``ids`` as a 1-D ``int32`` array (no copy when it already is one); ``ValueError`` if not
    1-D."""
    if type(ids) is np.ndarray and ids.dtype is _INT32 and ids.ndim == 1:
        return ids
    arr = np.asarray(ids, dtype=np.int32)
    if arr.ndim != 1:
        raise ValueError(f"token ids must be 1-D, got shape {arr.shape}")
    return arr


class Node:
    """Tree node; see the module docstring for the fields' meaning."""

    __slots__ = ("key", "pages", "slot", "parent", "children", "depth", "full_lock_ref",
                 "mamba_lock_ref", "alive", "extra_key", "first_page", "spec", "__weakref__")

    def __init__(self, key: np.ndarray, pages: np.ndarray, parent: Node | None, depth: int,
                 extra_key: Any = None):
        self.key = key  # int32[len]: token ids of the edge from the parent
        self.pages = pages  # int32[len // page_size]: KV page ids of those tokens
        self.slot: int | None = None
        self.parent = parent
        self.children: dict[bytes, Node] = {}
        self.depth = depth  # tokens from the root to the end of this node
        self.full_lock_ref = 0
        self.mamba_lock_ref = 0
        self.alive = True
        self.extra_key = extra_key
        # bytes of key[:page_size]: this node's key in parent.children (set when linked)
        self.first_page = b""
        self.spec = False  # the state is speculative (see the module docstring)

    @property
    def is_root(self) -> bool:
        return self.parent is None

    def __repr__(self) -> str:
        return (f"Node(depth={self.depth}, len={len(self.key)}, slot={self.slot}, "
                f"children={len(self.children)}, locks={self.full_lock_ref}/"
                f"{self.mamba_lock_ref}{', spec' if self.spec else ''})")


def make_root(extra_key: Any = None) -> Node:
    return Node(_EMPTY, _EMPTY, None, 0, extra_key)


def unlocked_states(order: Iterable[Node], num: int) -> list[Node]:
    """The first ``num`` nodes of ``order`` (a recency list of nodes with a state, oldest
    first) whose state no request locks (``mamba_lock_ref == 0``)."""
    out = []
    for node in order:
        if node.mamba_lock_ref == 0:
            out.append(node)
            if len(out) >= num:
                break
    return out


def path_pages(node: Node) -> np.ndarray:
    """``int32[depth // page_size]``: KV page ids from the root down to ``node``."""
    return _along_path(node, "pages")


def path_tokens(node: Node) -> np.ndarray:
    """``int32[depth]``: the token ids from the root down to the end of ``node``."""
    return _along_path(node, "key")


def _along_path(node: Node, field: str) -> np.ndarray:
    """``field`` (``pages`` or ``key``) of every node from the root down to ``node``, joined
    (a fresh array)."""
    parts = []
    while node.parent is not None:
        parts.append(getattr(node, field))
        node = node.parent
    if not parts:
        return _EMPTY.copy()
    if len(parts) == 1:
        return parts[0].copy()
    parts.reverse()
    return np.concatenate(parts)


def path_root(node: Node) -> Node:
    """The root above ``node`` (its ``extra_key`` is the node's namespace)."""
    while node.parent is not None:
        node = node.parent
    return node


@dataclasses.dataclass(slots=True)
class MatchResult:
    """What ``match_prefix`` found for a prompt.

    Attributes:
      cached_len: tokens served from the cache; a multiple of ``page_size`` and at most
        ``len(prompt) - 1`` (at least one token is always computed).
      page_ids: ``int32[cached_len // page_size]`` KV pages of those tokens (the tree's).
      read_slot: state slot holding the state after ``cached_len`` tokens; ``None`` iff
        ``cached_len == 0`` (read the zero state, slot 0).
      node: lock it (``cache.lock(node)``) while the request runs; unlock when done.
      branch_len: tokens of the prompt whose KV is in the tree (page multiple, >= cached_len):
        where the prompt leaves the tree, the natural branch-point snapshot position.
    """

    cached_len: int
    page_ids: np.ndarray
    read_slot: int | None
    node: Any
    branch_len: int


@dataclasses.dataclass(slots=True)
class InsertResult:
    """What ``insert`` did with the ids it took ownership of.

    Attributes:
      kept_len: tokens of the inserted sequence now in the tree (a page multiple: the deepest
        state on its path, existing or accepted; 0 if none). KV past it was freed.
      node: the node ending at ``kept_len`` (it holds a state), or the root when ``kept_len`` is 0.
        For a mid-flight insert the engine locks it and then unlocks its old node.
      page_ids: ``int32[kept_len // page_size]`` the tree's page ids for ``[0, kept_len)``. Where
        they differ from the pages passed in, the passed ones were duplicates and are now freed:
        a request still running must switch to these.
      accepted: snapshot positions whose slot the tree kept.
      rejected: snapshot positions whose slot was freed (not page aligned, outside
        ``(0, whole-page length]``, or that position already had a state).
      new_pages: pages the tree adopted; freed_pages: pages passed in and freed.
    """

    kept_len: int
    node: Any
    accepted: tuple[int, ...]
    rejected: tuple[int, ...]
    new_pages: int
    freed_pages: int

    @property
    def page_ids(self) -> np.ndarray:
        """``int32[kept_len // page_size]``: the tree's pages for ``[0, kept_len)`` (computed on
        access from ``node``'s path; read it before the node can be evicted)."""
        return path_pages(self.node)
