"""The shadow runner's host tier: host copies of the prefix keys it tracks, and the check of
every copy between the tiers against the prefix it claims (``cache/host_tier.py``).

``ShadowTier`` is a mixin of ``ShadowRunner`` (its ``kv_len`` / ``kv_key`` per KV position,
``slot_len`` / ``slot_key`` per slot, ``prefix_keys``, ``num_steps``). ``transfer(t)``:
  * a demotion checks that the device state at ``t.device_slot`` is the state after exactly
    ``t.tokens`` and that every copied device KV position holds its prefix of ``t.tokens``,
    then files them under the host ids;
  * a promotion checks the same of the host rows it reads and starts a load: it lands
    ``load_latency(slot)`` steps later (``load_ready``), and ``finish_load`` writes the device
    rows. Until then the device rows hold whatever they held: a step that read them would
    fail the oracle's read check, and ``pending_load_ids`` tells ``check_tree`` to skip them.
``check_host_tree(host)`` checks every host node's claimed prefix: its host state and the host
KV of its path hold exactly that prefix (the engine's integrity check calls it).
A wrong copy raises ``DataflowError`` naming the ids and both prefixes: a host hit that would
serve another prefix's state or KV fails here, before any step reads it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mambacache.engine.shadow.pools import DataflowError


class ShadowTier:
    """Host copies for ``ShadowRunner`` (module docstring)."""

    host_kv: dict[int, tuple[np.ndarray, np.ndarray]]  # set by ShadowRunner.__init__
    host_slot: dict[int, tuple[int, int]]
    num_steps: int
    transfers = 0
    # steps a load into a device slot takes to land (0: ready at once)
    load_latency: Any = None
    _loads: dict[int, tuple[Any, np.ndarray, np.ndarray, tuple[int, int], int]]

    def transfer(self, t: Any, in_use: Any = None) -> None:
        """Apply a ``cache.host_tier.Transfer``, checking what it copies."""
        ps, n = self.page_size, len(t.tokens)
        keys = self.prefix_keys(np.asarray(t.tokens))
        first = n // ps - len(t.device_pages)  # index of the first page copied
        pos = np.arange(first * ps, n)
        where = "demoted" if t.to_host else "promoted"
        if t.to_host:
            state = (int(self.slot_len[t.device_slot]), int(self.slot_key[t.device_slot]))
            locs = np.repeat(np.asarray(t.device_pages, np.int64), ps) * ps + pos % ps
            kv_len, kv_key = self.kv_len[locs].copy(), self.kv_key[locs].copy()
        else:
            state = self.host_slot.get(int(t.host_slot), (-1, 0))
            rows = [self.host_kv.get(int(p), (np.full(ps, -1), np.zeros(ps, np.uint64)))
                    for p in t.host_pages]
            kv_len = np.concatenate([r[0] for r in rows]) if rows else np.zeros(0, np.int64)
            kv_key = np.concatenate([r[1] for r in rows]) if rows else np.zeros(0, np.uint64)
        if state != (n, int(keys[n - 1])):
            raise DataflowError(
                f"{where} state (device slot {t.device_slot}, host slot {t.host_slot}) holds "
                f"the state after {state[0]} tokens of another prefix, not the {n} it claims")
        bad = np.flatnonzero((kv_key != keys[pos]) | (kv_len != pos + 1))
        if len(bad):
            p = int(pos[bad[0]])
            raise DataflowError(f"{where} KV position {p} (device pages "
                                f"{np.asarray(t.device_pages).tolist()}, host pages "
                                f"{np.asarray(t.host_pages).tolist()}) holds another prefix")
        if t.to_host:
            for i, hp in enumerate(np.asarray(t.host_pages).tolist()):
                self.host_kv[hp] = (kv_len[i * ps:(i + 1) * ps], kv_key[i * ps:(i + 1) * ps])
            self.host_slot[int(t.host_slot)] = state
        else:
            delay = self.load_latency(int(t.device_slot)) if self.load_latency else 0
            self._loads[int(t.device_slot)] = (t, kv_len, kv_key, state, self.num_steps + delay)
        self.transfers += 1

    def load_ready(self, device_slot: int) -> bool:
        return self.num_steps >= self._loads[int(device_slot)][4]

    def finish_load(self, device_slot: int) -> None:
        """Write the load's rows into the device rows (``HostPools.finish_load``)."""
        t, kv_len, kv_key, state, _ = self._loads.pop(int(device_slot))
        ps, n = self.page_size, len(t.tokens)
        pos = np.arange((n // ps - len(t.device_pages)) * ps, n)
        locs = np.repeat(np.asarray(t.device_pages, np.int64), ps) * ps + pos % ps
        self.kv_len[locs], self.kv_key[locs] = kv_len, kv_key
        self.slot_len[t.device_slot], self.slot_key[t.device_slot] = state

    def pending_load_ids(self) -> tuple[set[int], set[int]]:
        """The device slots and pages of the loads in flight (their rows not written yet)."""
        pages = {int(p) for t, *_ in self._loads.values() for p in t.device_pages}
        return set(self._loads), pages

    def check_host_tree(self, host: Any) -> None:
        """Raise ``DataflowError`` unless every state and KV page of the host tree ``host`` (a
        ``MambaRadixCache`` over host ids) holds the host copy of its node's token path."""
        ps = self.page_size
        todo = [(root, np.zeros(0, np.int32)) for root in host.roots.values()]
        while todo:
            node, path = todo.pop()
            path = np.concatenate([path, node.key]) if len(node.key) else path
            todo.extend((child, path) for child in node.children.values())
            if not len(path):
                continue
            keys, d = self.prefix_keys(path), node.depth
            if node.slot is not None and \
                    self.host_slot.get(int(node.slot), (-1, 0)) != (d, int(keys[d - 1])):
                raise DataflowError(f"host tree node at depth {d}: host slot {node.slot} holds "
                                    "the state of another prefix")
            first = d - len(node.key)
            for i, page in enumerate(np.asarray(node.pages).tolist()):
                pos = np.arange(first + i * ps, min(first + (i + 1) * ps, d))
                lens, got = self.host_kv.get(page, (None, None))
                if got is None or (got[:len(pos)] != keys[pos]).any():
                    raise DataflowError(f"host tree node at depth {d}: host page {page} holds "
                                        "another prefix")
