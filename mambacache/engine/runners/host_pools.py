"""Host pools of the host tier: the KV pages and state slots demoted from the device, in host
memory, and the jitted gather / scatter that move them (``cache/host_tier.py`` decides which
ids; this module only copies).

``HostPools.transfer(pools, t)`` issues a copy and never waits for one it does not need:
  * a demotion (``t.to_host``) is queued; ``flush`` (called before anything writes the pools:
    a step, a slot copy, a promotion's scatter) gathers every queued demotion's device rows
    (pages of every KV layer, conv + SSM of every linear layer) in ONE jitted program that reads
    the pools without donating them and starts its copy to the host. The rows are filed under
    their host ids when the copy has landed (``land``: non-blocking, at later transfers), or
    at once when a promotion reads one of them;
  * a promotion (``not t.to_host``) stacks the host rows and starts their copy to the device
    (``jax.device_put``, asynchronous) and returns: a *load in flight*. ``load_ready`` says
    whether it has landed; ``finish_load`` dispatches the scatter into ``t.device_pages`` /
    ``t.device_slot`` (one jitted program, pools donated, device-local): the data dependency
    through the pools orders it after every step dispatched before it and before every step
    dispatched after it. The scheduler finishes a load before the step that reads it and lets
    other requests step while it is in flight (``CacheManager.land_loads``).
States keep their pool dtypes on the host (fp32 SSM states stay fp32). Page counts and demotion
batches are padded to powers of two (pages at least ``MIN_TRANSFER_PAGES``, slots at least 1)
with the dump page 0 / the zero slot (their rows are garbage by contract): a finite set of
gather / scatter programs, compiled by ``Engine.warmup`` (``warm``) or on first use. Memory:
every host id holds one row set at most (a new owner's rows replace the old), so the rows never
pass the host budget; rows of ids the host tree no longer holds are dropped (``in_use``: the
tier's) when the rows have doubled since the last such walk (amortized, not per landing).

Where host rows live: ``host_memory_kind(device)``. On GPU / TPU devices that offer the
``pinned_host`` memory kind, a demotion's rows are copied into pinned host buffers
(``jax.device_put`` with that memory kind: an asynchronous DMA) and a promotion stages its
stacked rows through one before the device copy; on CPU (and devices without it) the rows are
numpy arrays and the copies plain ``device_put`` / ``device_get``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from mambacache.cache.host_tier import Transfer
from mambacache.engine.runners.pools import PoolState
from mambacache.engine.step.buckets import bucket

#: the narrowest transfer program (pages); wider ones are powers of two
MIN_TRANSFER_PAGES = 16
#: the most demoted states one gather copies (its slot widths: powers of two up to this)
MAX_BATCH_SLOTS = 8
#: host rows (pages + slots) below which landing never prunes
PRUNE_MIN_ROWS = 1024

InUse = Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]


def host_memory_kind(device: Any) -> str | None:
    """The JAX memory kind host rows use next to ``device``: ``"pinned_host"`` on an
    accelerator that offers it (``device.addressable_memories()``), else ``None`` (numpy rows in
    ordinary host memory: CPU, where the device memory already is host memory, or a device
    without pinned host memory)."""
    if getattr(device, "platform", "cpu") == "cpu":
        return None
    try:
        kinds = {m.kind for m in device.addressable_memories()}
    except (AttributeError, NotImplementedError):
        return None
    return "pinned_host" if "pinned_host" in kinds else None


def _gather(pools: PoolState, pages: jax.Array, slots: jax.Array) -> tuple:
    """The rows of ``pages`` in every KV layer and of ``slots`` in every state array."""
    return (tuple(a[pages] for a in pools.k_pages), tuple(a[pages] for a in pools.v_pages),
            tuple(a[slots] for a in pools.conv), tuple(a[slots] for a in pools.ssm))


def _scatter(pools: PoolState, pages: jax.Array, slots: jax.Array, rows: tuple) -> PoolState:
    k, v, conv, ssm = rows

    def put(arrays: tuple, values: tuple, idx: jax.Array) -> tuple:
        return tuple(a.at[idx].set(x.astype(a.dtype)) for a, x in zip(arrays, values,
                                                                        strict=True))

    return pools.replace(k_pages=put(pools.k_pages, k, pages), v_pages=put(pools.v_pages, v, pages),
                         conv=put(pools.conv, conv, slots), ssm=put(pools.ssm, ssm, slots))


@functools.cache
def _gather_fn():
    return jax.jit(_gather)


@functools.cache
def _scatter_fn():
    return jax.jit(_scatter, donate_argnums=(0,))


def _padded(ids: Sequence[int] | np.ndarray, least: int) -> np.ndarray:
    out = np.zeros(bucket(len(ids), least), np.int32)
    out[:len(ids)] = ids
    return out


def _ready(rows: Any) -> bool:
    return all(getattr(x, "is_ready", lambda: True)() for x in jax.tree_util.tree_leaves(rows))


def to_device(rows: tuple, pools: PoolState, memory_kind: str | None = None) -> tuple:
    """Start the copy of ``(k, v, conv, ssm)`` rows to the device, each placed like the pool
    array it goes into (staged through ``memory_kind`` host buffers when given)."""
    likes = (pools.k_pages, pools.v_pages, pools.conv, pools.ssm)

    def put(x: Any, like: jax.Array) -> jax.Array:
        if memory_kind is not None:
            x = jax.device_put(x, like.sharding.with_memory_kind(memory_kind))
        return jax.device_put(x, like.sharding)

    return tuple(tuple(put(x, a) for x, a in zip(part, like, strict=True))
                 for part, like in zip(rows, likes, strict=True))


class HostPools:
    """Host rows by host id, demotions queued or copying, loads in flight (module docstring)."""

    def __init__(self, memory_kind: str | None = None, copy_back: bool = False):
        self.memory_kind = memory_kind
        # start a demotion's copy to the host at its gather (not on CPU: the rows already are
        # host memory, and the copy's completion callback stalls the XLA thread, as the step
        # loop's ``ModelRunner.copy_back`` found)
        self.copy_back = copy_back
        self.pages: dict[int, tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]]] = {}
        self.slots: dict[int, tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]]] = {}
        self._queued: list[Transfer] = []  # demotions not gathered yet
        self._copying: list[tuple[list[Transfer], tuple]] = []  # gathered, copying to the host
        self._loads: dict[int, tuple[Transfer, tuple]] = {}  # device slot -> rows on the device
        self.row_bytes = [0, 0]  # bytes of one page's rows, of one slot's rows (once seen)
        self.gathers = 0  # gather programs dispatched (one per flushed batch of demotions)
        self._prune_at = PRUNE_MIN_ROWS  # rows (pages + slots) at which ``land`` prunes
        # the most pages one gather copies (``warm`` sets its widest width; one demotion may
        # pass it alone)
        self.max_batch_pages = 1 << 30

    # ---- demotions ---------------------------------------------------------------------------
    def flush(self, pools: PoolState) -> None:
        """Gather the queued demotions (one program per ``max_batch_pages`` pages and
        ``MAX_BATCH_SLOTS`` states: the warmed widths) and start their copy to the host; called
        before anything writes the pools (the ids may be reused by that write)."""
        while self._queued:
            n, pages = 0, 0
            for t in self._queued:
                if n and (n == MAX_BATCH_SLOTS
                          or pages + len(t.device_pages) > self.max_batch_pages):
                    break
                n, pages = n + 1, pages + len(t.device_pages)
            batch, self._queued = self._queued[:n], self._queued[n:]
            self._gather(pools, batch)

    def _gather(self, pools: PoolState, batch: list[Transfer]) -> None:
        pages = np.concatenate([t.device_pages for t in batch]).astype(np.int32)
        rows = _gather_fn()(pools, _padded(pages, MIN_TRANSFER_PAGES),
                            _padded([t.device_slot for t in batch], 1))
        self.gathers += 1
        if self.memory_kind is not None:  # an asynchronous DMA into pinned host buffers
            rows = jax.tree_util.tree_map(
                lambda x: jax.device_put(x, x.sharding.with_memory_kind(self.memory_kind)), rows)
        elif self.copy_back:
            for x in jax.tree_util.tree_leaves(rows):
                x.copy_to_host_async()
        self._copying.append((batch, rows))

    def land(self, in_use: InUse | None = None, *, block: bool = False) -> None:
        """File the demotions whose copies have landed under their host ids (in order, up to the
        first still copying); ``block``: wait for all of them."""
        done = 0
        for batch, rows in self._copying:
            if not block and not _ready(rows):
                break
            k, v, conv, ssm = jax.device_get(rows)
            first = 0
            for i, t in enumerate(batch):
                for j, hp in enumerate(t.host_pages.tolist(), start=first):
                    # copies: a view would keep the whole batch alive
                    self.pages[hp] = (tuple(a[j].copy() for a in k),
                                      tuple(a[j].copy() for a in v))
                first += len(t.host_pages)
                self.slots[int(t.host_slot)] = (tuple(a[i:i + 1].copy() for a in conv),
                                                tuple(a[i:i + 1].copy() for a in ssm))
            if not self.row_bytes[1]:
                self.row_bytes = [sum(a[0].nbytes for a in k + v),
                                  sum(a[0].nbytes for a in conv + ssm)]
            done += 1
        self._copying = self._copying[done:]
        if done and in_use is not None and len(self.pages) + len(self.slots) >= self._prune_at:
            self._prune(in_use)

    def _prune(self, in_use: InUse) -> None:
        """Drop rows of host ids the host tree no longer holds (a walk over every row)."""
        pages = np.fromiter(self.pages, np.int64, len(self.pages))
        slots = np.fromiter(self.slots, np.int64, len(self.slots))
        keep_pages, keep_slots = in_use(pages, slots)
        for p in pages[~keep_pages].tolist():
            del self.pages[p]
        for s in slots[~keep_slots].tolist():
            del self.slots[s]
        # amortized: the next prune once the rows have doubled (each id holds one row set at
        # most, so rows never pass the host budget's ids; pruning only returns memory early)
        self._prune_at = 2 * (len(self.pages) + len(self.slots)) + PRUNE_MIN_ROWS

    # ---- promotions (loads) ------------------------------------------------------------------
    def transfer(self, pools: PoolState, t: Transfer, in_use: InUse | None = None) -> None:
        """Issue ``t``: queue a demotion, or start a promotion's load (``finish_load`` later)."""
        if t.to_host:
            self._queued.append(t)
            self.land(in_use)
            return
        if self._pending_for(t):  # its rows are still on the device: land them first (rare:
            self.flush(pools)  # a prefix promoted right after its demotion)
            self.land(in_use, block=True)
        n, width = len(t.host_pages), bucket(len(t.host_pages), MIN_TRANSFER_PAGES)
        conv, ssm = self.slots[int(t.host_slot)]

        def stack(layer: int, part: int, like: jax.Array) -> np.ndarray:
            out = np.zeros((width, *like.shape[1:]), like.dtype)
            for i, p in enumerate(t.host_pages[:n].tolist()):
                out[i] = self.pages[p][part][layer]
            return out

        rows = (tuple(stack(i, 0, a) for i, a in enumerate(pools.k_pages)),
                tuple(stack(i, 1, a) for i, a in enumerate(pools.v_pages)), conv, ssm)
        self._loads[int(t.device_slot)] = (t, to_device(rows, pools, self.memory_kind))

    def _pending_for(self, t: Transfer) -> bool:
        """Whether a demotion not landed yet writes one of ``t``'s host ids (an id's landed
        rows may be an older owner's: the host tree reuses ids as soon as it evicts)."""
        if not (self._queued or self._copying):
            return False
        pending = self._queued + [d for batch, _ in self._copying for d in batch]
        slots = {int(d.host_slot) for d in pending}
        pages = {int(p) for d in pending for p in d.host_pages}
        return int(t.host_slot) in slots or any(int(p) in pages for p in t.host_pages)

    def load_ready(self, device_slot: int) -> bool:
        """Whether the load into ``device_slot`` has landed on the device (no wait)."""
        return _ready(self._loads[int(device_slot)][1])

    def finish_load(self, pools: PoolState, device_slot: int) -> PoolState:
        """Scatter the load into ``device_slot`` (and its pages) into the pools; new pools."""
        self.flush(pools)
        t, rows = self._loads.pop(int(device_slot))
        return _scatter_fn()(pools, _padded(t.device_pages, MIN_TRANSFER_PAGES),
                             np.asarray([t.device_slot], np.int32), rows)

    # ---- accounting --------------------------------------------------------------------------
    def nbytes(self) -> int:
        """Bytes of the host rows held now (landed)."""
        return len(self.pages) * self.row_bytes[0] + len(self.slots) * self.row_bytes[1]

    def reset(self) -> None:
        """The pools are gone: no row, no copy and no load is left."""
        self.pages.clear()
        self.slots.clear()
        self._queued.clear()
        self._copying.clear()
        self._loads.clear()


def warm(pools: PoolState, max_pages: int, max_slots: int = MAX_BATCH_SLOTS) -> PoolState:
    """Compile the gather of every width up to ``max_pages`` pages x ``max_slots`` slots and the
    scatter of every page width (one slot): page 0 and the zero slot gathered and written back
    onto themselves (no cached row changes)."""
    width = MIN_TRANSFER_PAGES
    while True:
        idx = np.zeros(width, np.int32)
        slots = 1
        while True:
            rows = _gather_fn()(pools, idx, np.zeros(slots, np.int32))
            if slots >= max_slots:
                break
            slots *= 2
        one = to_device(jax.device_get(_gather_fn()(pools, idx, np.zeros(1, np.int32))), pools)
        pools = _scatter_fn()(pools, idx, np.zeros(1, np.int32), one)
        del rows
        if width >= max_pages:
            return pools
        width *= 2
