"""The shadow runner's host tier: host copies of the prefix keys it tracks, and the check of
every copy between the tiers against the prefix it claims (``cache/host_tier.py``).

``ShadowTier`` is a mixin of ``ShadowRunner`` (its ``kv_len`` / ``kv_key`` per KV position,
``slot_len`` / ``slot_key`` per slot, ``prefix_keys``). ``transfer(t)``:
  * a demotion checks that the device state at ``t.device_slot`` is the state after exactly
    ``t.tokens`` and that every copied device KV position holds its prefix of ``t.tokens``,
    then files them under the host ids;
  * a promotion checks the same of the host rows it reads, then writes the device rows.
A wrong copy raises ``DataflowError`` naming the ids and both prefixes: a host hit that would
serve another prefix's state or KV fails here, before any step reads it.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class ShadowTier:
    """Host copies for ``ShadowRunner`` (module docstring)."""

    host_kv: dict[int, tuple[np.ndarray, np.ndarray]]  # set by ShadowRunner.__init__
    host_slot: dict[int, tuple[int, int]]
    transfers = 0

    def transfer(self, t: Any, in_use: Any = None) -> None:
        """Apply a ``cache.host_tier.Transfer``, checking what it copies."""
        from mambacache.engine.shadow_runner import DataflowError

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
            locs = np.repeat(np.asarray(t.device_pages, np.int64), ps) * ps + pos % ps
            self.kv_len[locs], self.kv_key[locs] = kv_len, kv_key
            self.slot_len[t.device_slot], self.slot_key[t.device_slot] = state
        self.transfers += 1
