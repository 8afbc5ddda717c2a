"""Host pools of the host tier: the KV pages and state slots demoted from the device, in host
memory (numpy), and the jitted gather / scatter that move them (``cache/host_tier.py`` decides
which ids; this module only copies).

``HostPools.transfer(pools, t)``:
  * a demotion (``t.to_host``) gathers the device rows ``t.device_pages`` (every KV layer) and
    ``t.device_slot`` (conv + SSM of every linear layer) in one jitted program that reads the
    pools without donating them, starts their copy to the host, and files them under the host
    ids when they land (at the next transfer: its dispatch never waits for its own copy);
  * a promotion (``not t.to_host``) stacks the host rows and scatters
    them into ``t.device_pages`` / ``t.device_slot`` in one jitted program with the pools
    donated: the data dependency through the pools orders it after every step dispatched
    before it and before every step dispatched after it (the step that reads it included).
States keep their pool dtypes on the host (fp32 SSM states stay fp32). Page counts are padded
to a power of two (at least ``MIN_TRANSFER_PAGES``) with the dump page 0 (its rows are garbage
by contract): one gather and one scatter program per width, compiled by ``Engine.warmup``
(``warm``: page 0 and the zero slot copied onto themselves) or on first use. Memory: host rows
whose ids the host tree no longer holds are dropped whenever new rows land (``in_use``: the
tier's), so the host size is never held twice.

On GPU / TPU the rows are numpy arrays in ordinary host memory (``jax.device_get``), not pinned
(``pinned_host``) buffers: a promotion stages them through a copy.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import numpy as np

from mambacache.cache.host_tier import Transfer
from mambacache.engine.buckets import bucket
from mambacache.engine.pools import PoolState

#: the narrowest transfer program (pages); wider ones are powers of two
MIN_TRANSFER_PAGES = 16


def _gather(pools: PoolState, pages: jax.Array, slot: jax.Array) -> tuple:
    """The rows of ``pages`` in every KV layer and of ``slot`` in every state array."""
    return (tuple(a[pages] for a in pools.k_pages), tuple(a[pages] for a in pools.v_pages),
            tuple(a[slot] for a in pools.conv), tuple(a[slot] for a in pools.ssm))


def _scatter(pools: PoolState, pages: jax.Array, slot: jax.Array, rows: tuple) -> PoolState:
    k, v, conv, ssm = rows

    def put(arrays: tuple, values: tuple, idx: jax.Array) -> tuple:
        return tuple(a.at[idx].set(x.astype(a.dtype)) for a, x in zip(arrays, values,
                                                                        strict=True))

    return pools.replace(k_pages=put(pools.k_pages, k, pages), v_pages=put(pools.v_pages, v, pages),
                         conv=put(pools.conv, conv, slot), ssm=put(pools.ssm, ssm, slot))


@functools.cache
def _gather_fn():
    return jax.jit(_gather)


@functools.cache
def _scatter_fn():
    return jax.jit(_scatter, donate_argnums=(0,))


class HostPools:
    """Host rows by host id (module docstring)."""

    def __init__(self):
        self.pages: dict[int, tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]]] = {}
        self.slots: dict[int, tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]]] = {}
        self._pending: list[tuple[Transfer, tuple]] = []
        self.row_bytes = [0, 0]  # bytes of one page's rows, of one slot's rows (once seen)

    def _padded(self, ids: np.ndarray) -> np.ndarray:
        out = np.zeros(bucket(len(ids), MIN_TRANSFER_PAGES), np.int32)
        out[:len(ids)] = ids
        return out

    def transfer(self, pools: PoolState, t: Transfer,
                 in_use: Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]
                 | None = None) -> PoolState:
        """Apply ``t``; returns the pools (new ones after a promotion)."""
        self.land(in_use)  # the copies issued before this one
        if t.to_host:
            rows = _gather_fn()(pools, self._padded(t.device_pages), np.int32(t.device_slot))
            for x in jax.tree_util.tree_leaves(rows):
                x.copy_to_host_async()
            self._pending.append((t, rows))
            return pools
        n = len(t.host_pages)
        width = len(self._padded(t.host_pages))
        k_rows = [self.pages[int(p)][0] for p in t.host_pages]
        v_rows = [self.pages[int(p)][1] for p in t.host_pages]
        conv, ssm = self.slots[int(t.host_slot)]

        def stack(per_page: list, layer: int, like: jax.Array) -> np.ndarray:
            out = np.zeros((width, *like.shape[1:]), like.dtype)
            for i in range(n):
                out[i] = per_page[i][layer]
            return out

        k = tuple(stack(k_rows, i, a) for i, a in enumerate(pools.k_pages))
        v = tuple(stack(v_rows, i, a) for i, a in enumerate(pools.v_pages))
        return _scatter_fn()(pools, self._padded(t.device_pages), np.int32(t.device_slot),
                             (k, v, conv, ssm))

    def land(self, in_use=None) -> None:
        """File the pending demotions' rows under their host ids (waits for their copies)."""
        for t, rows in self._pending:
            k, v, conv, ssm = jax.device_get(rows)
            for i, hp in enumerate(t.host_pages.tolist()):  # copies: a view keeps the batch
                self.pages[hp] = (tuple(a[i].copy() for a in k), tuple(a[i].copy() for a in v))
            self.slots[int(t.host_slot)] = (tuple(conv), tuple(ssm))
            if not self.row_bytes[1]:
                self.row_bytes = [sum(a[0].nbytes for a in k + v),
                                  sum(np.asarray(a).nbytes for a in conv + ssm)]
        landed, self._pending = bool(self._pending), []
        if landed and in_use is not None:
            self._prune(in_use)

    def _prune(self, in_use) -> None:
        """Drop rows of host ids the host tree no longer holds."""
        pages = np.fromiter(self.pages, np.int64, len(self.pages))
        slots = np.fromiter(self.slots, np.int64, len(self.slots))
        keep_pages, keep_slots = in_use(pages, slots)
        for p in pages[~keep_pages].tolist():
            del self.pages[p]
        for s in slots[~keep_slots].tolist():
            del self.slots[s]

    def nbytes(self) -> int:
        """Bytes of the host rows held now (landed)."""
        return len(self.pages) * self.row_bytes[0] + len(self.slots) * self.row_bytes[1]

    def reset(self) -> None:
        self.pages.clear()
        self.slots.clear()
        self._pending.clear()


def warm(pools: PoolState, max_pages: int) -> PoolState:
    """Compile the gather and the scatter of every width up to ``max_pages`` pages: page 0 and
    the zero slot gathered and written back onto themselves (no cached row changes)."""
    width = MIN_TRANSFER_PAGES
    while True:
        idx = np.zeros(width, np.int32)
        rows = jax.device_get(_gather_fn()(pools, idx, np.int32(0)))
        pools = _scatter_fn()(pools, idx, np.int32(0), rows)
        if width >= max_pages:
            return pools
        width *= 2
