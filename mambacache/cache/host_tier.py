"""The host tier: a second radix tree in host memory that device eviction demotes into and a
match promotes back from (``cache.host_memory_bytes``; 0 = off). Host only: no JAX.

Residency. The device tree (the ``MambaRadixCache`` the engine allocates from) says what is on
the device; ``HostTier.host``, a ``MambaRadixCache`` over host page / slot ids with its own
``ByteBudget`` (the same page and slot bytes as the device, one limit for KV and states: the host
size is never split or counted twice), says what is in host memory. A prefix is on the device,
on the host, or on both (a promoted prefix keeps its host copy: a later device eviction of it
copies nothing). ``residency(tokens)`` answers for one prefix; ``check`` audits both trees.

* **Demote, do not delete.** The device tree calls ``demote(node)`` (``evict_hook``) before it
  drops a state (a leaf with its KV, or an internal state): the node's path tokens, the KV
  pages of the path not on the host yet and the state are copied into freshly allocated host
  ids (host eviction by the host tree's policy over the one host byte pool), and the node is
  inserted into the host tree with that state. A speculative state (``prompt_len - 1``, a
  checkpoint) is demoted too when the host has room for it (free bytes, or bytes of other
  speculative host states: ``_room_for_bet``) and stays speculative there: the first to go,
  until a promotion shows it pays. A re-sent prompt that extends the previous one (a client
  editing or growing its context) can resume only from that state. No room (everything on the
  host locked, or the path larger than the host budget): the node is deleted and
  ``demotions_skipped`` counts it.
* **Promote on match.** ``promote(prompt)`` before the device match: when the host holds a
  state deeper than the device's (``peek``), the device reserves a slot and the pages past the
  KV it shares, the host copy is scattered into them, and the prefix is inserted into the device
  tree (a firm state); the device match then finds it. The host node stays locked while the
  device allocates (its evictions demote into the host, never over the pages being read).
  With ``async_loads`` (a runner whose loads land later) the device node stays locked by the
  tier and listed in ``loading`` (device slot -> node, issue order) until ``landed``: no step
  reads it before (``CacheManager.land_loads`` and the scheduler see to that).
* Every copy is a ``Transfer`` handed to ``on_transfer`` (the engine's runner gathers or
  scatters the pool rows; the shadow runner moves the prefixes it tracks) at the moment the ids
  are chosen, before the ids can be reused: copies are issued in the order the ids change hands.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from mambacache.cache.allocator import TREE
from mambacache.cache.budget import ByteBudget
from mambacache.cache.node import Node, as_tokens, path_pages, path_root, path_tokens
from mambacache.cache.radix import MambaRadixCache

_EMPTY = np.zeros(0, dtype=np.int32)
#: the host tree's eviction order (``eviction.py``): expected saving per byte held
HOST_EVICTION = "saving_per_byte"


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One copy between the tiers: ``device_pages[i]`` <-> ``host_pages[i]`` and the state
    ``device_slot`` <-> ``host_slot``. ``to_host``: a demotion (device -> host), else a
    promotion. ``tokens``: the prefix whose state the slot holds (its KV: the path's pages)."""

    to_host: bool
    device_pages: np.ndarray
    host_pages: np.ndarray
    device_slot: int
    host_slot: int
    tokens: np.ndarray

    def num_bytes(self, budget: ByteBudget) -> int:
        return len(self.host_pages) * budget.page_bytes + budget.slot_bytes


class HostTier:
    """A host tree behind a device tree; see the module docstring."""

    def __init__(self, device: Any, budget: ByteBudget, eviction: str = HOST_EVICTION):
        if not isinstance(device, MambaRadixCache):
            raise ValueError(f"a host tier needs a radix cache on the device, got {device!r}")
        self.device = device
        self.budget = budget
        self.host = MambaRadixCache(budget.num_pages, budget.num_slots, device.page_size,
                                    eviction, speculative_states=False, budget=budget)
        self.on_transfer: Callable[[Transfer], None] | None = None
        # loads in flight (``async_loads``: the runner lands promotions later): device slot ->
        # the device node it fills, locked by the tier until ``landed``; issue order
        self.async_loads = False
        self.loading: dict[int, Node] = {}
        # ... and the device pages each of those loads fills (the KV past what was on device)
        self.loading_pages: dict[int, np.ndarray] = {}
        # host seconds spent issuing copies (a promotion waits for pending demotions to land)
        self.load_wait_s = 0.0
        self.counters = {"host_hit_tokens": 0, "tokens_promoted": 0, "bytes_demoted": 0,
                         "bytes_promoted": 0, "demotions": 0, "promotions": 0,
                         "demotions_skipped": 0, "promotions_skipped": 0,
                         # speculative states (prompt_len - 1, checkpoints) kept on the host
                         "speculative_demotions": 0,
                         # a request left out of a step because its load had not landed
                         "load_wait_steps": 0}
        device.evict_hook = self.demote
        device.host_tier = self

    # --------------------------------------------------------------------------- demote
    def demote(self, node: Node) -> bool:
        """Copy ``node``'s path KV and state to the host (the device is about to drop them);
        False when it stays device-only (no room). Called by the device tree's eviction."""
        ps, b = self.device.page_size, self.budget
        depth = node.depth
        if (depth // ps) * b.page_bytes + b.slot_bytes > b.limit_bytes:
            self.counters["demotions_skipped"] += 1
            return False
        tokens, extra = path_tokens(node), path_root(node).extra_key
        shared, _, end = self.host.locate(tokens, extra)
        if end is not None and end.slot is not None:  # the host has it already (promoted)
            self.host.match_prefix(np.append(tokens, 0), extra)  # refresh its recency
            return True
        if node.spec and not self._room_for_bet(depth // ps - shared // ps):
            self.counters["demotions_skipped"] += 1
            return False
        slot = self.host.alloc_slots(1)
        got = self._reserve(self.host, tokens, extra) if slot is not None else None
        if got is None:
            if slot is not None:
                self.host.free_slots(slot)
            self.counters["demotions_skipped"] += 1
            return False
        shared, host_shared, new = got
        device_pages = path_pages(node)[shared // ps:]
        self._issue(Transfer(True, device_pages, new, int(node.slot), int(slot[0]), tokens))
        if node.spec:  # a bet on the host too: it goes before any firm host state
            self.host.spec_slots.add(int(slot[0]))
            self.counters["speculative_demotions"] += 1
        self.host.insert(tokens, np.concatenate([host_shared, new]), {depth: int(slot[0])},
                         extra_key=extra)
        self.counters["demotions"] += 1
        self.counters["bytes_demoted"] += len(new) * b.page_bytes + b.slot_bytes
        return True

    def has_room(self, tokens: int) -> bool:
        """Whether the host's free bytes hold a state and the KV of ``tokens`` tokens now."""
        b = self.budget
        need = -(-tokens // self.device.page_size) * b.page_bytes + b.slot_bytes
        return need <= self.host.free_bytes()

    def _room_for_bet(self, new_pages: int) -> bool:
        """Whether a speculative state and ``new_pages`` KV pages fit in the host's free bytes
        plus those of its unlocked speculative states (a bet never pushes out a firm host
        state)."""
        b, host = self.budget, self.host
        need = new_pages * b.page_bytes + b.slot_bytes
        return need <= host.free_bytes() + host.evictable_speculative_slots() * b.slot_bytes

    @staticmethod
    def _reserve(tree: Any, tokens: np.ndarray, extra: Any):
        """``(shared, shared_pages, new_pages)``: pages of ``tree`` for ``tokens`` past the KV it
        already holds (allocating may evict some of that KV: re-read until it holds), or
        ``None`` when the pages cannot be had (whatever was taken is given back)."""
        ps, new = tree.page_size, _EMPTY
        while True:
            shared, shared_pages, _ = tree.locate(tokens, extra)
            need = len(tokens) // ps - shared // ps - len(new)
            if need <= 0:
                return shared, shared_pages, new
            more = tree.alloc_pages(need)
            if more is None:
                if len(new):
                    tree.free_pages(new)
                return None
            new = np.concatenate([new, more]).astype(np.int32)

    # --------------------------------------------------------------------------- promote
    def promote(self, prompt_ids, extra_key: Any = None) -> int:
        """Bring the deepest host-resident state on ``prompt_ids``'s path (and the KV before it)
        to the device when it is deeper than the device's; returns the tokens that gained
        (0: nothing to promote, or no device room: then the request computes them)."""
        tokens = as_tokens(prompt_ids)
        on_device = self.device.peek(tokens, extra_key)
        if self.host.peek(tokens, extra_key) <= on_device:
            return 0
        m = self.host.match_prefix(tokens, extra_key)
        host_len = m.cached_len
        self.host.lock(m.node)
        try:
            slot = self.device.alloc_slots(1)
            got = self._reserve(self.device, tokens[:host_len], extra_key) \
                if slot is not None else None
            if got is None:
                if slot is not None:
                    self.device.free_slots(slot)
                self.counters["promotions_skipped"] += 1
                return 0
            shared, device_shared, new = got
            ps = self.device.page_size
            self._issue(Transfer(False, new, m.page_ids[shared // ps:], int(slot[0]),
                                 int(m.read_slot), tokens[:host_len]))
            self.device.insert(tokens[:host_len], np.concatenate([device_shared, new]),
                               {host_len: int(slot[0])}, extra_key=extra_key)
            if self.async_loads:  # its rows arrive later: nothing may evict or reuse them
                node = self.device.locate(tokens[:host_len], extra_key)[2]
                self.device.lock(node)
                self.loading[int(slot[0])] = node
                self.loading_pages[int(slot[0])] = np.asarray(new)
        finally:
            self.host.unlock(m.node)
        gained = host_len - on_device
        self.counters["promotions"] += 1
        self.counters["tokens_promoted"] += gained
        self.counters["bytes_promoted"] += len(new) * self.budget.page_bytes + \
            self.budget.slot_bytes
        return gained

    def landed(self, device_slot: int) -> None:
        """The load into ``device_slot`` is in the pools (its scatter dispatched): its node
        becomes an ordinary device node (unlocked)."""
        self.device.unlock(self.loading.pop(int(device_slot)))
        self.loading_pages.pop(int(device_slot))

    def _issue(self, transfer: Transfer) -> None:
        if self.on_transfer is not None:
            t0 = time.perf_counter()
            self.on_transfer(transfer)
            self.load_wait_s += time.perf_counter() - t0

    # --------------------------------------------------------------------------- reporting
    def residency(self, token_ids, extra_key: Any = None) -> str:
        """Where the state after ``token_ids`` (and its KV) lives: ``"device"``, ``"host"``,
        ``"both"`` or ``"none"``."""
        tokens = as_tokens(token_ids)
        where = [name for name, tree in (("device", self.device), ("host", self.host))
                 if (end := tree.locate(tokens, extra_key)[2]) is not None
                 and end.slot is not None]
        return "both" if len(where) == 2 else (where[0] if where else "none")

    def count_hit(self, tokens: int) -> None:
        """Count ``tokens`` of an admitted request's match that the host held (``promote``'s
        gain for it): ``host_hit_tokens``."""
        self.counters["host_hit_tokens"] += tokens

    def in_use(self, page_ids: np.ndarray, slot_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Masks: which of these host page / slot ids the host tree holds now (a runner drops
        the rows of the others)."""
        return (self.host.pages.status_of(page_ids) == TREE,
                self.host.slots.status_of(slot_ids) == TREE)

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.counters)
        out.update(load_wait_s=self.load_wait_s, host_memory_bytes=self.budget.limit_bytes,
                   host_bytes_held=self.host.kv_bytes_held() + self.host.state_bytes_held(),
                   host_tree_states=len(self.host.lru_state))
        return out

    def check(self) -> None:
        """The host tree's invariants (``check_tree`` + the byte accounting), nothing locked
        or held on the host between calls, and the device tree still pointing here."""
        self.host.check_integrity()
        if self.host.pages.num_held or self.host.slots.num_held or \
                self.host.locked_pages() or self.host.locked_slots():
            raise AssertionError(
                f"host tier: {self.host.pages.num_held} pages / {self.host.slots.num_held} slots "
                f"held and {self.host.locked_slots()} states locked between calls")
        if self.device.evict_hook != self.demote:
            raise AssertionError("host tier: the device tree's evict_hook is not this tier's")
        if self.host.budget is self.device.budget or self.host.budget is not self.budget:
            raise AssertionError("host tier: the host tree must draw on its own byte budget")
        if self.loading.keys() != self.loading_pages.keys():
            raise AssertionError(f"host tier: loads {sorted(self.loading)} but pages of loads "
                                 f"{sorted(self.loading_pages)}")
        for slot, node in self.loading.items():
            if not node.alive or node.slot != slot or node.mamba_lock_ref <= 0 or \
                    self.device.slots.status_of(np.asarray([slot]))[0] != TREE:
                raise AssertionError(f"host tier: the load into device slot {slot} fills "
                                     f"{node!r}, which is not a locked tree node of that slot")


def attach_host_tier(device: Any, host_memory_bytes: int, page_bytes: int = 0,
                     slot_bytes: int = 0, eviction: str = HOST_EVICTION) -> HostTier | None:
    """A ``HostTier`` of ``host_memory_bytes`` behind ``device``, pages and slots of the
    device's budget's sizes (else ``page_bytes`` / ``slot_bytes``); ``None`` when the size is 0
    or the device cache is not a radix tree. ``ValueError`` when no sizes are known."""
    from mambacache.cache.radix import MambaRadixCache

    if not host_memory_bytes or not isinstance(device, MambaRadixCache):
        return None
    if device.budget is not None:
        page_bytes, slot_bytes = device.budget.page_bytes, device.budget.slot_bytes
    if not (page_bytes and slot_bytes):
        raise ValueError(
            f"cache.host_memory_bytes ({host_memory_bytes}) needs the bytes of a KV page "
            f"({page_bytes}) and a state slot ({slot_bytes}): set cache.state_bytes and "
            f"cache.kv_bytes_per_token, or run a model")
    return HostTier(device, ByteBudget(int(host_memory_bytes), page_bytes, slot_bytes),
                    eviction)
