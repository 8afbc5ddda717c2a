"""The radix tree as plain data, and back: what a warm restart needs besides the pool rows.

``dump_tree`` walks the public structure of a ``MambaRadixCache`` (``roots``, ``Node.children``,
``lru_state``) and returns JSON-able dicts; ``load_tree`` rebuilds an equivalent tree in a FRESH
cache through its public API only (``alloc_pages`` / ``alloc_slots`` / ``insert`` /
``match_prefix``), with new page and slot ids, and returns the old -> new id maps so the caller
can move the pool rows. Equivalent = the same states at the same token paths, each firm or
speculative as it was, the same recency order of the firm states and of the speculative ones
(evicted first, in their own order); a tombstone with a single child is not recreated (matching
is unaffected).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from mambacache.cache.node import Node

if TYPE_CHECKING:
    from mambacache.cache.radix import MambaRadixCache


def _path_tokens(node: Node) -> np.ndarray:
    parts = []
    while node.parent is not None:
        parts.append(node.key)
        node = node.parent
    parts.reverse()
    return np.concatenate(parts) if parts else np.zeros(0, np.int32)


def _walk(root: Node):
    stack = [root]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children.values())


def dump_tree(cache: MambaRadixCache) -> dict[str, Any]:
    """``{"page_size", "pages": [old page ids], "slots": [old slot ids], "states": [...]}``.

    ``states`` lists every node holding a state, least recently used first: ``{"extra_key",
    "tokens": [ids of the whole path], "pages": [old page ids of the path], "slot": old slot,
    "spec": speculative (kept while it pays, evicted first)}``.
    """
    roots = getattr(cache, "roots", None)
    if roots is None:  # the disabled cache holds nothing
        return {"page_size": cache.page_size, "pages": [], "slots": [], "states": []}
    for key in roots:
        if key is not None and not isinstance(key, str):
            raise ValueError(f"cannot save a cache namespace with extra_key {key!r}: only str "
                             f"or None keys are saved")
    pages = [int(p) for root in roots.values() for n in _walk(root) for p in n.pages]
    states = []
    for node in cache.lru_state:
        path_pages = []
        walk = node
        while walk.parent is not None:
            path_pages.append(walk.pages)
            walk = walk.parent
        path_pages.reverse()
        states.append({
            "extra_key": node.extra_key,
            "tokens": _path_tokens(node).tolist(),
            "pages": np.concatenate(path_pages).tolist() if path_pages else [],
            "slot": int(node.slot),
            "spec": bool(node.spec),
        })
    return {"page_size": cache.page_size, "pages": sorted(pages),
            "slots": sorted(s["slot"] for s in states), "states": states}


def _ids(name: str, value: Any) -> list[int]:
    if not isinstance(value, list) or not all(type(v) is int and v >= 0 for v in value):
        raise ValueError(f"saved tree: {name} must be a list of ids >= 0")
    return value


def check_tree_data(tree: Any) -> None:
    """``ValueError`` naming the first way ``tree`` is not what ``dump_tree`` writes: the keys,
    id lists without repeats, every state's pages among ``pages`` and covering its tokens, its
    slot among ``slots`` and owned by no other state. Touches no cache."""
    if not isinstance(tree, dict):
        raise ValueError(f"saved tree is a {type(tree).__name__}, not an object")
    missing = [k for k in ("page_size", "pages", "slots", "states") if k not in tree]
    if missing:
        raise ValueError(f"saved tree lacks {missing}")
    page_size = tree["page_size"]
    if type(page_size) is not int or page_size < 1:
        raise ValueError(f"saved tree: page_size {page_size!r}")
    pages, slots = set(_ids("pages", tree["pages"])), set(_ids("slots", tree["slots"]))
    if len(pages) != len(tree["pages"]) or len(slots) != len(tree["slots"]):
        raise ValueError("saved tree: a page or slot id is listed twice")
    if not isinstance(tree["states"], list):
        raise ValueError("saved tree: states must be a list")
    used: set[int] = set()
    for i, s in enumerate(tree["states"]):
        if not isinstance(s, dict) or not {"tokens", "pages", "slot"} <= s.keys():
            raise ValueError(f"saved tree: state {i} lacks tokens, pages or slot")
        tokens, path = _ids(f"state {i} tokens", s["tokens"]), _ids(f"state {i} pages", s["pages"])
        if not tokens or len(path) * page_size < len(tokens) or not set(path) <= pages:
            raise ValueError(f"saved tree: state {i} ({len(tokens)} tokens) has pages {path[:8]} "
                             f"that do not cover it or are not among the saved pages")
        if s["slot"] not in slots or s["slot"] in used:
            raise ValueError(f"saved tree: state {i}'s slot {s['slot']!r} is not a saved slot "
                             "or belongs to another state")
        used.add(s["slot"])
        if not isinstance(s.get("extra_key"), str | None) or not isinstance(s.get("spec", False),
                                                                            bool):
            raise ValueError(f"saved tree: state {i} has a bad extra_key or spec")


def check_room(cache: MambaRadixCache, tree: dict[str, Any]) -> None:
    """``ValueError`` when ``cache`` cannot take ``tree``'s pages and slots together, as it is
    now (ids, and bytes under a budget; a moved device split may hold fewer than the config
    says). ``load_tree`` checks it before allocating anything: a load failing half-way would
    leave pages held by nobody."""
    num_pages, num_slots = len(tree["pages"]), len(tree["slots"])
    has_pages, has_slots = cache.available_pages(), cache.available_slots()
    fits = num_pages <= has_pages and num_slots <= has_slots
    budget = getattr(cache, "budget", None)
    if fits and budget is not None:
        need = num_pages * budget.page_bytes + num_slots * budget.slot_bytes
        fits = need <= cache.free_bytes() + cache.evictable_bytes()
    if not fits:
        raise ValueError(f"saved cache needs {num_pages} KV pages and {num_slots} state slots; "
                         f"this engine has {has_pages} pages and {has_slots} slots")


def load_tree(cache: MambaRadixCache,
              tree: dict[str, Any]) -> tuple[dict[int, int], dict[int, int]]:
    """Rebuild ``tree`` (from ``dump_tree``) into the empty ``cache``.

    Returns ``(page_map, slot_map)``: old id -> new id. ``ValueError`` if the cache's page size
    differs or its pools are too small for the saved tree.
    """
    if tree["page_size"] != cache.page_size:
        raise ValueError(f"saved cache has page_size {tree['page_size']}, this engine "
                         f"{cache.page_size}")
    if not tree["states"]:
        return {}, {}
    if not hasattr(cache, "roots"):
        raise ValueError("cannot restore a saved tree into a disabled cache (cache.enable=false)")
    old_pages, old_slots = tree["pages"], tree["slots"]
    check_room(cache, tree)
    new_pages = cache.alloc_pages(len(old_pages))
    new_slots = cache.alloc_slots(len(old_slots))
    if new_pages is None or new_slots is None:  # check_room's sums make this unreachable
        raise AssertionError(f"load_tree: {len(old_pages)} pages and {len(old_slots)} slots "
                             f"passed the room check but could not be allocated")
    page_map = dict(zip(old_pages, new_pages.tolist(), strict=True))
    slot_map = dict(zip(old_slots, new_slots.tolist(), strict=True))
    firm = [s for s in tree["states"] if not s.get("spec", False)]
    spec = [s for s in tree["states"] if s.get("spec", False)]
    # Firm states by depth, then the speculative ones in their saved order (their slots marked
    # speculative first: insert stores them so). A speculative node never gets a second child
    # this way, so nothing promotes it, and the recency touches below end at firm nodes.
    for s in sorted(firm, key=lambda s: len(s["tokens"])) + spec:
        pages = np.asarray([page_map[p] for p in s["pages"]], dtype=np.int32)
        depth, slot = len(s["tokens"]), slot_map[s["slot"]]
        if s.get("spec", False):
            cache.spec_slots.add(slot)
        res = cache.insert(s["tokens"], pages, snapshots={depth: slot}, extra_key=s["extra_key"])
        if res.kept_len != depth:
            raise ValueError(f"restoring the tree: state at depth {depth} was not kept")
    for s in firm:  # recency: touch each firm state in the saved LRU order
        cache.match_prefix(list(s["tokens"]) + [0], extra_key=s["extra_key"])
    return page_map, slot_map
